"""Proxies that route requests themselves: the JSQ stand-in for an existing router (`pdproxy`),
later BalanceRoute in the path (active mode)."""

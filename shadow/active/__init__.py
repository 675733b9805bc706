"""Routing requests ourselves: the active P/D proxy (`proxy`) with its dispatcher, prefill choice and
mode controller, and the JSQ stand-in for an existing router built from it (`standin`)."""

"""shadow: a BalanceRoute sidecar for data-parallel LLM decode fleets."""

__version__ = "0.1.0"

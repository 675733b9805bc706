"""vLLM's wire, read side: OpenAI-compatible SSE/JSON responses (`sse`) and the Prometheus
`/metrics` page with its scraper (`metrics`). Imports nothing else from shadow."""

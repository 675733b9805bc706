"""Real vLLM servers for shadow: the model builder, the launcher and the in-engine step probe."""

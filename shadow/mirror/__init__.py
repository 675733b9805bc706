"""The mirror: in-path taps, SSE analysis, the mirrored fleet state, reconciliation, event API."""

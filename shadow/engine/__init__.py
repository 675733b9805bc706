"""The discrete-step fleet engine: lanes of routing policies on one shared event stream."""

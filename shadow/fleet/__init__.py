"""A vLLM-compatible simulated DP decode fleet over real HTTP (prefill servers + decode ranks on
a barrier-synchronised step clock, vLLM SSE and /metrics, NIXL-style P/D handles, faults).

Start it with `Fleet` (async) or `FleetThread` (sync), or `shadow fleet` on the command line.
"""

from shadow.fleet.config import FleetConfig
from shadow.fleet.faults import FaultSpec, Target
from shadow.fleet.fleet import Fleet, FleetThread

__all__ = ["FaultSpec", "Fleet", "FleetConfig", "FleetThread", "Target"]

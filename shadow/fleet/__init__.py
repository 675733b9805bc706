"""A vLLM-compatible simulated DP decode fleet over real HTTP (no accelerator needed).

Servers (one port each; `shadow fleet` prints their URLs as one JSON line):
- prefill i (BASE+i): P/D prefill legs (`kv_transfer_params.do_remote_decode: true`) are served
  FCFS, one at a time, in (c0 + c1·prompt)·time_scale, and return a NIXL-style handle; the KV is
  held (visible in `vllm:kv_cache_usage_perc`) until a decode pulls it or `kv_ttl_s` passes.
  Other requests run on the server's own one-rank engine.
- decode rank g (BASE+100+g): B slots and a FIFO waiting queue; all ranks step on one barrier
  clock, step = max_g (a·L_g + b)·slow_g × time_scale, one token per running request per step.
  Decode legs must carry a live handle (else 400); requests without one prefill locally.
- optional all-ranks port (BASE+200, `dp_front`): `X-data-parallel-rank` picks the rank.

Endpoints: POST /v1/completions, /v1/chat/completions (vLLM 0.33 SSE and JSON, see `sse`);
GET /health, /v1/models, /metrics (vLLM names plus `shadow_fleet_*` step ground truth), /load,
/get_load, /version, /fleet/state; GET/POST /fleet/faults (see `faults`). `X-Request-Id` is
used in response ids and echoed. Token and output-length rules: see `tokens`. Given a tracer
(`shadow fleet --otlp-traces-endpoint URL`), each finished request makes vLLM's `llm_request`
SERVER span, the child of its `traceparent` (see `tracing`).

Start it with `Fleet` (async context manager):

    async with Fleet(FleetConfig(prefill=1, decode=2, base_port=0, time_scale=0.25)) as fleet:
        fleet.decode_urls; await fleet.inject("decode/1", stall_s=1.0)
"""

from shadow.fleet.config import FleetConfig
from shadow.fleet.faults import FaultSpec, Target
from shadow.fleet.fleet import Fleet

__all__ = ["FaultSpec", "Fleet", "FleetConfig", "Target"]

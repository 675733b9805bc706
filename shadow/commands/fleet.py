"""`shadow fleet`: run the simulated vLLM fleet until SIGINT/SIGTERM.

Prints exactly one JSON line on stdout when every server listens:
`{"prefill": [urls], "decode": [urls]}` (plus `"dp": url` with --dp-front).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from shadow.app import fleet as fleet_app
from shadow.base.knobs import add_knobs, knob_values
from shadow.commands import fleet_vllm
from shadow.commands._service import add_log_arguments, run_reporting, start_logging
from shadow.fleet.config import FleetConfig
from shadow.fleet.faults import FaultSpec

EPILOG = """examples:
  shadow fleet                                   # 1 prefill + 2 decode ranks on ports 18000 / 18100-18101
  shadow fleet --prefill 1 --decode 4 --slots 16 --port 0       # free ports (read them from the JSON line)
  shadow fleet --decode 8 --time-scale 0.25      # steps four times faster than the model
  shadow fleet --fault decode/1:slow=2 --fault decode/0:stall_s=2@5   # a slow rank; a stall after 5 s
  shadow fleet --engine vllm --decode 2          # two real vLLM CPU servers (scripts/install-vllm.sh first)
  shadow fleet --engine vllm --prefill 1 --decode 1 --model-size mid   # a real P/D pair, ~20 ms steps
  curl -s http://127.0.0.1:18100/metrics | grep -E 'vllm:num_requests_running|shadow_fleet_step'

Decode legs must carry the kv_transfer_params a prefill server returned (P/D, as vllm-router or
`shadow router --prefill ...` sends them); requests without them are prefilled locally (plain mode).
"""


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "fleet",
        help="run a simulated vLLM prefill/decode fleet (OpenAI API, SSE, /metrics, P/D, faults)",
        description=(
            "Serve prefill servers on PORT+i and DP decode ranks on PORT+100+g, all stepping on one "
            "barrier clock: step = (a·max_g L_g + b) × time-scale. Prints one JSON line with the "
            "URLs when ready; stops on SIGINT/SIGTERM."
        ),
        epilog=EPILOG,
    )
    add_knobs(p, FleetConfig)  # the fleet's settings, declared on FleetConfig
    # not given: the environment's token (a knob's default is fixed; this one is read at start-up)
    p.set_defaults(control_token=os.environ.get("SHADOW_FLEET_CONTROL_TOKEN"))
    p.add_argument(
        "--fault",
        action="append",
        default=[],
        metavar="TARGET:key=value[,...][@AT]",
        help="inject a fault, e.g. decode/0:stall_s=2@5, decode/1:cut_after=10, "
        "prefill/0:http_status=503 (keys: see shadow.fleet.faults)",
    )
    p.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        metavar="URL",
        help="export one `llm_request` span per request, the child of its traceparent, to this OTLP "
        "endpoint (vLLM's flag: grpc unless OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf, then "
        "the URL ends in /v1/traces); with --engine vllm it is passed to each server",
    )
    fleet_vllm.add_arguments(p)
    add_log_arguments(p)
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> FleetConfig:
    """The simulated fleet's config: every setting from its flag (`--prefill`, `--port` not given:
    the field's default), the faults from `--fault`."""
    given = {name: v for name, v in knob_values(args, FleetConfig).items() if v is not None}
    return FleetConfig(**given, faults=tuple(FaultSpec.parse(f) for f in args.fault))


def run(args: argparse.Namespace) -> int:
    if args.engine == "vllm":
        return fleet_vllm.run(args)
    def body() -> None:
        config = config_from_args(args)
        start_logging("shadow fleet", args)
        fleet_app.run(config, args.otlp_traces_endpoint)

    return run_reporting("shadow fleet", body)

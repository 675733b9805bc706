"""`shadow fleet`: run the simulated vLLM fleet until SIGINT/SIGTERM.

Prints exactly one JSON line on stdout when every server listens:
`{"prefill": [urls], "decode": [urls]}` (plus `"dp": url` with --dp-front).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from shadow.app import fleet as fleet_app
from shadow.commands import fleet_vllm
from shadow.commands._service import add_log_arguments, run_reporting, start_logging
from shadow.core.stepmodel import DEFAULT_A_S_PER_TOKEN, DEFAULT_B_S
from shadow.fleet.config import DEFAULT_BASE_PORT, DEFAULT_MODEL, FleetConfig
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


def register(subparsers: Any) -> None:  # long by design: the command's flags, one statement each
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
    p.add_argument("--prefill", type=int, default=None, metavar="N",
                   help="prefill servers (default 1; 0 with --engine vllm)")
    p.add_argument("--decode", type=int, default=2, metavar="G", help="decode DP ranks (default 2)")
    p.add_argument("--slots", type=int, default=64, metavar="B", help="running slots per rank (default 64)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument(
        "--control-token",
        default=os.environ.get("SHADOW_FLEET_CONTROL_TOKEN"),
        help="bearer token for POST /fleet/faults (env SHADOW_FLEET_CONTROL_TOKEN); without one, fault "
        "injection is refused unless the fleet listens on loopback",
    )
    p.add_argument(
        "--port",
        type=int,
        default=None,
        metavar="BASE",
        help=f"base port (default {DEFAULT_BASE_PORT}; free ports with --engine vllm; 0 = free ports)",
    )
    p.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        metavar="X",
        help="wall seconds per model second (default 1; 0.1 runs 10× faster)",
    )
    p.add_argument(
        "--a", type=float, default=DEFAULT_A_S_PER_TOKEN, help="step seconds per KV token of max load"
    )
    p.add_argument("--b", type=float, default=DEFAULT_B_S, help="fixed step seconds")
    p.add_argument("--prefill-c0", type=float, default=0.010, help="prefill seconds per request")
    p.add_argument("--prefill-c1", type=float, default=2.0e-5, help="prefill seconds per prompt token")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"served model name (default {DEFAULT_MODEL})")
    p.add_argument("--max-model-len", type=int, default=32768)
    p.add_argument("--kv-tokens", type=int, default=1 << 20, help="KV capacity per engine, in tokens")
    p.add_argument("--kv-ttl", type=float, default=480.0, help="seconds a prefill holds KV nobody pulled")
    p.add_argument(
        "--catch-up",
        type=float,
        default=0.0,
        metavar="S",
        help="keep the step model's timeline on a busy host: make up to S seconds of lateness "
        "(held-up steps end at once); default 0: only a lateness shorter than the step",
    )
    p.add_argument(
        "--mean-output-tokens",
        type=int,
        default=128,
        help="mean output length of requests without ignore_eos (deterministic draw)",
    )
    p.add_argument("--max-body-bytes", type=int, default=8 << 20, help="request body limit (413 above)")
    p.add_argument(
        "--dp-front",
        action="store_true",
        help="also serve all decode ranks on PORT+200, chosen by X-data-parallel-rank",
    )
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
    return FleetConfig(
        prefill=1 if args.prefill is None else args.prefill,
        decode=args.decode,
        slots=args.slots,
        host=args.host,
        base_port=DEFAULT_BASE_PORT if args.port is None else args.port,
        control_token=args.control_token,
        time_scale=args.time_scale,
        a=args.a,
        b=args.b,
        prefill_c0=args.prefill_c0,
        prefill_c1=args.prefill_c1,
        model=args.model,
        max_model_len=args.max_model_len,
        kv_capacity_tokens=args.kv_tokens,
        kv_ttl_s=args.kv_ttl,
        catch_up_s=args.catch_up,
        mean_output_tokens=args.mean_output_tokens,
        max_body_bytes=args.max_body_bytes,
        dp_front=args.dp_front,
        faults=tuple(FaultSpec.parse(f) for f in args.fault),
    )


def run(args: argparse.Namespace) -> int:
    if args.engine == "vllm":
        return fleet_vllm.run(args)
    def body() -> None:
        config = config_from_args(args)
        start_logging("shadow fleet", args)
        fleet_app.run(config, args.otlp_traces_endpoint)

    return run_reporting("shadow fleet", body)

"""`shadow fleet --engine vllm`: real vLLM CPU servers instead of the simulated double.

Same ready line (`{"prefill": [urls], "decode": [urls]}`) and the same stop behaviour: SIGINT or
SIGTERM stops every server (its whole process group) before the command exits, as does a failed
start, which names the server that did not come up and quotes its log.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from shadow.base.knobs import knobs
from shadow.fleet.config import FleetConfig

SIM_ONLY = ("dp_front", "fault", "time_scale")  # options the real engine has no use for


def add_arguments(p: Any) -> None:
    g = p.add_argument_group(
        "real engine (--engine vllm; install it with scripts/install-vllm.sh)",
        "G decode servers (and --prefill N prefill servers in a NixlConnector P/D pair, "
        "ExampleConnector where NIXL is absent), one core each, free loopback ports.",
    )
    g.add_argument("--engine", choices=("sim", "vllm"), default="sim",
                   help="sim: the simulated fleet (default); vllm: real vLLM CPU servers")
    g.add_argument("--vllm-venv", metavar="DIR", default=None,
                   help="the engine venv (default $SHADOW_VLLM_VENV, else the repository's .venv-vllm)")
    g.add_argument("--model-size", choices=("tiny", "mid", "moe"), default="tiny",
                   help="the built-in random model: tiny (fast), mid (~20 ms steps) or moe (tiny with 4 "
                   "experts per layer); default tiny")
    g.add_argument("--model-seed", type=int, default=0, help="seed of the built model (default 0)")
    g.add_argument("--model-path", metavar="DIR", default=None,
                   help="serve this model directory instead of building one")
    g.add_argument("--data-parallel", type=int, default=1, metavar="N",
                   help="DP engines per decode server (vLLM's --data-parallel-size, one core each; "
                   "its /metrics labels each engine; default 1)")
    g.add_argument("--dp-ports", action="store_true",
                   help="with --data-parallel N: one API server (port, core, decode worker of the ready "
                   "line) per DP rank, vLLM's external-LB mode; the ranks stay one DP group")
    g.add_argument("--moe-dp-collectives", action="store_true",
                   help="add the CPU collectives vLLM 0.32 lacks for an MoE model under DP (all_gatherv, "
                   "reduce_scatterv; without them --model-size moe --data-parallel 2 dies on its first "
                   "forward pass)")
    g.add_argument("--kv-bytes", type=int, default=128 << 20, metavar="BYTES",
                   help="KV cache per server (default 128 MiB: 131k tokens of the tiny model)")
    g.add_argument("--connector", choices=("auto", "nixl", "example"), default="auto",
                   help="P/D KV connector with --prefill (default auto: NIXL when it imports)")
    g.add_argument("--probe-url", metavar="URL", default=os.environ.get("SHADOW_PROBE_URL"),
                   help="shadow serve's event API: every engine step is posted there by shadow's probe "
                   "(env SHADOW_PROBE_URL)")
    g.add_argument("--probe-token", metavar="TOKEN", default=os.environ.get("SHADOW_PROBE_TOKEN"),
                   help="bearer token for --probe-url: that serve's --probe-token (it admits steps only) or "
                   "its --events-token (env SHADOW_PROBE_TOKEN)")
    g.add_argument("--log-dir", metavar="DIR", default=None,
                   help="where each server's log goes (default: a new temporary directory)")
    g.add_argument("--start-timeout", type=float, default=600.0, metavar="S",
                   help="seconds every server has to answer /health (default 600)")


def run(args: argparse.Namespace) -> int:
    from shadow.app import fleet as fleet_app
    from shadow.commands._service import start_logging
    from shadow.realvllm.launcher import VllmFleet, VllmFleetConfig

    used = _sim_only(args)
    if used:
        flags = ", ".join("--" + n.replace("_", "-") for n in used)
        print(f"shadow fleet: {flags} only apply to the simulated fleet (--engine sim)", file=sys.stderr)
        return 2
    try:
        config = VllmFleetConfig(
            decode=args.decode, prefill=args.prefill if args.prefill is not None else 0, host=args.host,
            served_model_name=args.model, model_size=args.model_size, model_seed=args.model_seed,
            model_path=Path(args.model_path) if args.model_path else None,
            data_parallel=args.data_parallel, dp_ports=args.dp_ports,
            moe_dp_collectives=args.moe_dp_collectives, max_num_seqs=args.slots,
            max_model_len=min(args.max_model_len, 2048), kv_bytes=args.kv_bytes,
            connector=args.connector, probe_url=args.probe_url, probe_token=args.probe_token,
            venv=Path(args.vllm_venv) if args.vllm_venv else None,
            log_dir=Path(args.log_dir) if args.log_dir else None, start_timeout_s=args.start_timeout,
            ports=_ports(args),
            extra_args=(("--otlp-traces-endpoint", args.otlp_traces_endpoint)
                        if args.otlp_traces_endpoint else ()),
        )
        fleet = VllmFleet(config)
    except (ValueError, FileNotFoundError) as exc:
        print(f"shadow fleet: {exc}", file=sys.stderr)
        return 2
    start_logging("shadow fleet", args)
    if config.log_dir is not None:
        config.log_dir.mkdir(parents=True, exist_ok=True)
    try:
        fleet_app.run_vllm(fleet)
    except RuntimeError as exc:  # StartError, or a server that exited
        print(f"shadow fleet: {exc}", file=sys.stderr)
        return 1
    return 0


def _sim_only(args: argparse.Namespace) -> list[str]:
    """The SIM_ONLY options given a value other than their default (FleetConfig's, for a setting)."""
    defaults = {k.dest: f.default for f, k in knobs(FleetConfig)}
    return [name for name in SIM_ONLY
            if getattr(args, name, None) not in (None, False, [], defaults.get(name))]


def _ports(args: argparse.Namespace) -> tuple[int, ...] | None:
    """--port BASE (given, non-zero): prefill i on BASE+i, decode g on BASE+100+g (as the simulated fleet;
    with --dp-ports, decode worker k, rank r of server k // N, on BASE+100+k)."""
    if not args.port:
        return None
    base = int(args.port)
    prefill = args.prefill if args.prefill is not None else 0
    per = args.data_parallel if args.dp_ports else 1
    return tuple([base + i for i in range(prefill)] + [base + 100 + k for k in range(args.decode * per)])

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

from shadow.base.knobs import add_knobs, knob_values, knobs
from shadow.fleet.config import FleetConfig
from shadow.realvllm.launcher import ENV_VENV, VllmFleetConfig

SIM_ONLY = ("dp_front", "fault", "time_scale")  # options the real engine has no use for


def add_arguments(p: Any) -> None:
    """The real engine's group: `--engine`, the settings declared on `VllmFleetConfig` (`add_knobs`),
    and the flags whose default is read from the environment when the parser is built (`--vllm-venv`
    is looked up again at run time: `find_engine_venv`), which a knob's fixed default cannot say."""
    g = p.add_argument_group(
        "real engine (--engine vllm; install it with scripts/install-vllm.sh)",
        "G decode servers (and --prefill N prefill servers in a NixlConnector P/D pair, "
        "ExampleConnector where NIXL is absent), one core each, free loopback ports.",
    )
    g.add_argument("--engine", choices=("sim", "vllm"), default="sim",
                   help="sim: the simulated fleet (default); vllm: real vLLM CPU servers")
    g.add_argument("--vllm-venv", metavar="DIR", default=None,
                   help=f"the engine venv (default ${ENV_VENV}, else the repository's .venv-vllm)")
    add_knobs(g, VllmFleetConfig)  # the real engine's settings, declared on VllmFleetConfig
    g.add_argument("--probe-url", metavar="URL", default=os.environ.get("SHADOW_PROBE_URL"),
                   help="shadow serve's event API: every engine step is posted there by shadow's probe "
                   "(env SHADOW_PROBE_URL)")
    g.add_argument("--probe-token", metavar="TOKEN", default=os.environ.get("SHADOW_PROBE_TOKEN"),
                   help="bearer token for --probe-url: that serve's --probe-token (it admits steps only) or "
                   "its --events-token (env SHADOW_PROBE_TOKEN)")


def config_from_args(args: argparse.Namespace) -> VllmFleetConfig:
    """The real fleet's config: its own settings from their flags (`knob_values`), the fleet's shape
    from `shadow fleet`'s shared flags (`--prefill` not given: 0; `--max-model-len` at most 2048),
    the probe and the venv from their flags or the environment. ValueError naming a flag."""
    return VllmFleetConfig(
        **knob_values(args, VllmFleetConfig),
        decode=args.decode, prefill=args.prefill if args.prefill is not None else 0, host=args.host,
        served_model_name=args.model, max_num_seqs=args.slots, max_model_len=min(args.max_model_len, 2048),
        probe_url=args.probe_url, probe_token=args.probe_token,
        venv=Path(args.vllm_venv) if args.vllm_venv else None, ports=_ports(args),
        extra_args=(("--otlp-traces-endpoint", args.otlp_traces_endpoint)
                    if args.otlp_traces_endpoint else ()),
    )


def run(args: argparse.Namespace) -> int:
    from shadow.app import fleet as fleet_app
    from shadow.commands._service import start_logging
    from shadow.realvllm.launcher import VllmFleet

    used = _sim_only(args)
    if used:
        flags = ", ".join("--" + n.replace("_", "-") for n in used)
        print(f"shadow fleet: {flags} only apply to the simulated fleet (--engine sim)", file=sys.stderr)
        return 2
    try:
        config = config_from_args(args)
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

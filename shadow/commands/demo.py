"""`shadow demo`: the live loop on loopback — a simulated fleet, an existing router (the vllm-ascend
proxy's JSQ rule, or the real vllm-router), `shadow serve` with taps in front of every worker, and
the synthetic paper-like workload at saturation through the official openai client. A live view
shows what the router did (`actual`) beside what BR-0/BR-H and JSQ-bytes would have done, on the
same traffic. Needs no accelerator, no network and no extras. Stop it early with Ctrl-C.
"""

from __future__ import annotations

import argparse
import sys

from shadow.app.demo import FLEETS, ROUTERS, DemoOptions
from shadow.app.logs import FORMATS, LEVELS
from shadow.app.vllmshape import MOE_RANKS, SHAPES, SPARE_CORES

D = DemoOptions()
# --fleet vllm: two real CPU servers of the tiny model (one core each); prompts ÷ 24 so the longest
# (8,000 words) fits its 2,048-token context (its tokenizer makes ~2.9 tokens of a load-generator
# word); a configured step model near what the engines step at on a busy 2-core machine (the fit
# from the probe replaces it when it holds); real engines on a loaded machine run far slower than
# the configured model says, so what is still running after the arrivals gets up to 10 minutes
VLLM = DemoOptions(fleet="vllm", workers=2, slots=8, load=0.6, step_a=1e-6, step_b=0.02, prompt_divisor=24,
                   drain_timeout_s=600.0)
SIZED = ("workers", "slots", "load", "step_a", "step_b")

EPILOG = f"""examples:
  shadow demo                                    # live loop, {D.duration_s:g} s, live view
  shadow demo --duration 300                     # longer runs settle the averages
  shadow demo --headless --duration 60 --record session.ndjson --report-json report.json
  shadow demo --router vllm-router               # the real vllm-router (pip install vllm-router)
  shadow demo --fleet vllm --headless --duration 90 --report-json r.json
                                                 # real vLLM CPU servers (scripts/install-vllm.sh): the
                                                 # MoE DP pair where the cores allow, else independent
  shadow demo --offline                          # the offline table instead: 4,000 requests replayed
  shadow replay paper-azure --load 1.1           # ... or any offline comparison, one command away

The workload is SYNTHETIC (paper-azure) and time-compressed: outputs ÷ {D.output_divisor}, arrivals at
ρ × the fleet's estimated capacity. The fleet steps on T = a·max_g L_g + b (a={D.step_a:g} s/token,
b={D.step_b:g} s by default); `shadow serve` fits a and b from the streams it sees. While it runs:
curl the /v1/report and /metrics URLs it prints.
"""


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not value > 0 or value != value or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return value


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "demo",
        help="the live loop: simulated fleet + JSQ router + shadow serve + paper-like load, live view",
        description=__doc__,
        epilog=EPILOG,
    )
    p.add_argument("--duration", type=_positive_float, default=D.duration_s, metavar="S",
                   help="seconds of arrivals; requests still running then finish (within 60 s; --fleet vllm: "
                   "600 s), then it stops")
    p.add_argument("--requests", type=_positive_int, default=None, metavar="N",
                   help="send at most N requests (default: every request arriving within --duration; "
                   "with --offline: 4000)")
    p.add_argument("--log-level", choices=LEVELS, default="info", type=str.lower,
                   help="least severe level the shadow processes log (to their files in the work "
                   "directory the demo names) (default info)")
    p.add_argument("--log-format", choices=FORMATS, default="text",
                   help="their log lines as text or json (default text)")
    p.add_argument("--headless", action="store_true",
                   help="no live view: progress lines on stderr, the final table on stdout")
    p.add_argument("--record", metavar="FILE",
                   help="record the mirrored session (replay it with shadow replay)")
    p.add_argument("--report-json", metavar="FILE",
                   help='write the final /v1/report plus a "demo" block (fleet truth, router, requests)')
    p.add_argument("--router", choices=ROUTERS, default=D.router,
                   help="the existing router: jsq-bytes = `shadow router` (the vllm-ascend proxy's JSQ-bytes "
                   "rule; formerly spelled jsq), or vllm-router (found beside the interpreter, then on PATH)")
    p.add_argument("--router-policy", default=D.router_policy, help="vllm-router's --policy")
    p.add_argument("--fleet", choices=FLEETS, default=D.fleet,
                   help="sim: the simulated P/D fleet (default); vllm: real vLLM CPU servers as the "
                   f"decode workers, plain mode, their step probe posting to the sidecar (defaults "
                   f"then: -G {VLLM.workers} -B {VLLM.slots} --load {VLLM.load:g} --step-a {VLLM.step_a:g} "
                   f"--step-b {VLLM.step_b:g}, prompts ÷ {VLLM.prompt_divisor})")
    p.add_argument("--model-size", choices=("tiny", "mid"), default=VLLM.model_size,
                   help="--fleet vllm, independent servers: the built-in random model (tiny: fast; mid: "
                   "~20 ms steps)")
    p.add_argument("--vllm-fleet", choices=SHAPES, default=VLLM.vllm_fleet,
                   help=f"--fleet vllm: moe-dp = the {MOE_RANKS} DP ranks of one MoE server in lockstep (a "
                   "real barrier), independent = separate servers; auto picks the pair when the machine "
                   f"has the cores for it (>= {MOE_RANKS + SPARE_CORES} usable cores, {MOE_RANKS} of them "
                   f"free by the load average, -G {MOE_RANKS}) and prints why not otherwise (default "
                   f"{VLLM.vllm_fleet})")
    p.add_argument("--vllm-venv", metavar="DIR", default=None,
                   help="--fleet vllm: the engine venv (default $SHADOW_VLLM_VENV, else .venv-vllm)")
    p.add_argument("--workers", "-G", type=_positive_int, default=None,
                   help=f"decode ranks (default {D.workers})")
    p.add_argument("--slots", "-B", type=_positive_int, default=None,
                   help=f"slots per decode rank (default {D.slots})")
    p.add_argument("--load", type=_positive_float, default=None, metavar="RHO",
                   help=f"arrival rate as ρ × the fleet's estimated capacity (default {D.load:g})")
    p.add_argument("--step-a", type=_positive_float, default=None, metavar="A",
                   help="the fleet's true step cost per KV token of the largest rank (s/token; default "
                   f"{D.step_a:g}); with --fleet vllm the lanes' configured model")
    p.add_argument("--step-b", type=_positive_float, default=None, metavar="B",
                   help=f"the fleet's true fixed step cost (s; default {D.step_b:g}); with --fleet vllm "
                   "the lanes' configured model")
    p.add_argument("--time-scale", type=_positive_float, default=D.time_scale, metavar="X",
                   help="fleet wall seconds per model second (0.5 = twice as fast; more CPU)")
    p.add_argument("--seed", type=int, default=D.seed, help="seed of the synthetic workload")
    p.add_argument("--rolling", action="store_true",
                   help="rolling counterfactual (serve --rolling): every lane re-seeded from the mirrored "
                   "fleet at each comparison window; the table adds each lane's last-window spread")
    p.add_argument("--offline", action="store_true",
                   help="print the offline comparison instead (paper-azure replayed through every "
                   "policy at G=8, B=64, ρ=1.1; no processes)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.offline:
        from shadow.commands import replay
        from shadow.commands._help import ShadowArgumentParser

        argv = ["paper-azure", "--load", "1.1", "--limit", str(args.requests or 4000)]
        parser = ShadowArgumentParser()
        replay.register(parser.add_subparsers())
        return replay.run(parser.parse_args(["replay", *argv]))
    from rich.console import Console

    from shadow.app.demo import DemoOptions, run_demo

    base = VLLM if args.fleet == "vllm" else D
    sized = {k: getattr(args, k) if getattr(args, k) is not None else getattr(base, k) for k in SIZED}
    if args.fleet == "vllm" and args.time_scale != D.time_scale:
        print("shadow demo: --time-scale only applies to the simulated fleet", file=sys.stderr)
        return 2
    opts = DemoOptions(
        **sized, time_scale=args.time_scale, fleet=args.fleet, prompt_divisor=base.prompt_divisor,
        drain_timeout_s=base.drain_timeout_s,
        model_size=args.model_size, vllm_venv=args.vllm_venv, vllm_fleet=args.vllm_fleet,
        duration_s=args.duration, requests=args.requests, router=args.router,
        router_policy=args.router_policy, seed=args.seed, record=args.record, rolling=args.rolling,
        report_json=args.report_json, headless=args.headless,
        log_level=args.log_level, log_format=args.log_format,
    )
    console = Console() if Console().is_terminal else Console(width=170)
    try:
        err = Console(stderr=True)
        return run_demo(opts, console, err if err.is_terminal else Console(stderr=True, width=170))
    except (RuntimeError, ValueError, OSError) as exc:
        print(f"shadow demo: {exc}", file=sys.stderr)
        return 2

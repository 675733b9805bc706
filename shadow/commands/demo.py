"""`shadow demo`: the live loop on loopback — a simulated fleet, an existing router (the vllm-ascend
proxy's JSQ rule, or the real vllm-router), `shadow serve` with taps in front of every worker, and
the synthetic paper-like workload at saturation through the official openai client. A live view
shows what the router did (`actual`) beside what BR-0/BR-H and JSQ-bytes would have done, on the
same traffic. Needs no accelerator, no network and no extras. Stop it early with Ctrl-C.
"""

from __future__ import annotations

import argparse
import sys

from shadow.app.demo import ROUTERS, DemoOptions

D = DemoOptions()

EPILOG = f"""examples:
  shadow demo                                    # live loop, {D.duration_s:g} s, live view
  shadow demo --duration 300                     # longer runs settle the averages
  shadow demo --headless --duration 60 --record session.ndjson --report-json report.json
  shadow demo --router vllm-router               # the real vllm-router (pip install vllm-router)
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
                   help="seconds of arrivals; requests still running then finish (bounded), then it stops")
    p.add_argument("--requests", type=_positive_int, default=None, metavar="N",
                   help="send at most N requests (default: every request arriving within --duration; "
                   "with --offline: 4000)")
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
    p.add_argument("--workers", "-G", type=_positive_int, default=D.workers, help="decode ranks")
    p.add_argument("--slots", "-B", type=_positive_int, default=D.slots, help="slots per decode rank")
    p.add_argument("--load", type=_positive_float, default=D.load, metavar="RHO",
                   help="arrival rate as ρ × the fleet's estimated capacity")
    p.add_argument("--step-a", type=_positive_float, default=D.step_a, metavar="A",
                   help="the fleet's true step cost per KV token of the largest rank (s/token)")
    p.add_argument("--step-b", type=_positive_float, default=D.step_b, metavar="B",
                   help="the fleet's true fixed step cost (s)")
    p.add_argument("--time-scale", type=_positive_float, default=D.time_scale, metavar="X",
                   help="fleet wall seconds per model second (0.5 = twice as fast; more CPU)")
    p.add_argument("--seed", type=int, default=D.seed, help="seed of the synthetic workload")
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

    opts = DemoOptions(
        workers=args.workers, slots=args.slots, load=args.load, time_scale=args.time_scale,
        step_a=args.step_a, step_b=args.step_b,
        duration_s=args.duration, requests=args.requests, router=args.router,
        router_policy=args.router_policy, seed=args.seed, record=args.record,
        report_json=args.report_json, headless=args.headless,
    )
    console = Console() if Console().is_terminal else Console(width=170)
    try:
        err = Console(stderr=True)
        return run_demo(opts, console, err if err.is_terminal else Console(stderr=True, width=170))
    except (RuntimeError, ValueError, OSError) as exc:
        print(f"shadow demo: {exc}", file=sys.stderr)
        return 2

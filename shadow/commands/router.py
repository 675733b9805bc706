"""`shadow router`: a stand-in for an existing router — the vllm-ascend P/D proxy's JSQ rule.

Decode choice by outstanding request-body bytes (ties to the first --decode given), prefill choice
by 0.3 × outstanding prefill score, both legs with one X-Request-Id; without --prefill it routes
plain requests to the decode backends by the same rule. It is shadow's active proxy in a fixed
mode (`shadow.active.standin`). Prints one JSON line `{"url": URL}` when it listens; stops on
SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from shadow.active.standin import RouterConfig
from shadow.app import router as router_app
from shadow.base.knobs import PORT, argument, check_knobs, knob, knob_values, knobs
from shadow.commands._service import add_log_arguments, run_reporting, start_logging

PROG = "shadow router"
EPILOG = """examples:
  # P/D: one prefill server, two decode ranks (e.g. from `shadow fleet --prefill 1 --decode 2`)
  shadow router --prefill http://127.0.0.1:18000 \\
                --decode http://127.0.0.1:18100 --decode http://127.0.0.1:18101 --port 8000
  # plain mode (no prefill stage), named backends, round robin instead of JSQ
  shadow router --decode d0=http://127.0.0.1:18100 --decode d1=http://127.0.0.1:18101 --policy round-robin
  # then send OpenAI requests to it:
  shadow load paper-azure --target http://127.0.0.1:8000 --limit 100

policies: jsq-bytes (vllm-ascend's load-balance proxy: decode = least outstanding body bytes,
prefill = least 0.3 × outstanding (0.0345·bytes/4 + 120.0745)); round-robin (vLLM's toy proxy).
"""


@dataclass(frozen=True)
class Listen:
    """Where `shadow router` listens."""

    host: str = knob("127.0.0.1", "--host", "bind address")
    port: int = knob(8000, "--port", "listen port (0 = a free port)", PORT)

    def __post_init__(self) -> None:
        check_knobs(self)


def _backends(values: Sequence[str] | None, prefix: str, flag: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for i, v in enumerate(values or ()):
        name, sep, url = v.partition("=")
        if not sep:
            name, url = f"{prefix}{i}", v
        if not name or not url:
            raise ValueError(f"{flag} must be URL or NAME=URL, got {v!r}")
        if name in out:
            raise ValueError(f"{flag} name {name!r} given twice")
        out[name] = url
    return out


def register(subparsers: Any) -> None:
    """The command's flags. Its settings are declared once (`shadow.base.knobs`): the router's in
    `RouterConfig`'s fields (`--policy`, `--max-body-bytes`, `--max-connections`, `--prefill-retries`),
    where it listens in `Listen`'s (`--host`, `--port`); their flags, defaults and checks derive from
    them. `--decode` and `--prefill` stay hand-written: repeatable [NAME=]URL lists, parsed into the
    config's backends (`_backends`)."""
    summary = "a stand-in router: the vllm-ascend P/D proxy's JSQ rule (prefill + decode, or plain)"
    p = subparsers.add_parser("router", help=summary, description=__doc__, epilog=EPILOG)
    p.add_argument("--decode", action="append", metavar="[NAME=]URL", required=True,
                   help="a decode (or plain) backend; repeatable, registration order breaks ties")
    p.add_argument("--prefill", action="append", metavar="[NAME=]URL",
                   help="a prefill backend; repeatable (none: plain mode, requests go straight to decode)")
    router = list(knobs(RouterConfig))
    for f, k in [*router[:1], *knobs(Listen), *router[1:]]:  # --policy, where it listens, then the rest
        p.add_argument(k.flag, dest=k.dest, **argument(f, k))
    add_log_arguments(p)
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    config = RouterConfig(
        decode=_backends(args.decode, "d", "--decode"),
        prefill=_backends(args.prefill, "p", "--prefill"),
        **knob_values(args, RouterConfig),
    )
    config.active_config()  # validates (one-line errors)
    return config


def run(args: argparse.Namespace) -> int:
    def body() -> None:
        config = config_from_args(args)
        listen = Listen(**knob_values(args, Listen))
        start_logging(PROG, args)
        router_app.run(config, listen.host, listen.port)

    return run_reporting(PROG, body)

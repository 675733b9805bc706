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
from typing import Any

from shadow.active.standin import POLICIES, RouterConfig
from shadow.app import router as router_app
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
    summary = "a stand-in router: the vllm-ascend P/D proxy's JSQ rule (prefill + decode, or plain)"
    p = subparsers.add_parser("router", help=summary, description=__doc__, epilog=EPILOG)
    p.add_argument("--decode", action="append", metavar="[NAME=]URL", required=True,
                   help="a decode (or plain) backend; repeatable, registration order breaks ties")
    p.add_argument("--prefill", action="append", metavar="[NAME=]URL",
                   help="a prefill backend; repeatable (none: plain mode, requests go straight to decode)")
    p.add_argument("--policy", choices=POLICIES, default="jsq-bytes",
                   help="routing rule: jsq-bytes (the vllm-ascend proxy's: least outstanding request-body "
                   "bytes) or rr / round-robin (default jsq-bytes)")
    p.add_argument("--host", default="127.0.0.1", help="bind address")
    p.add_argument("--port", type=int, default=8000, help="listen port (0 = a free port)")
    p.add_argument("--max-body-bytes", type=int, default=8 << 20, help="request body limit (413 above)")
    p.add_argument("--max-connections", type=int, default=1024, help="upstream connection pool size")
    p.add_argument("--prefill-retries", type=int, default=3,
                   help="retries of a request before anything reached the client: a failed prefill leg "
                        "(on another prefiller when there is one), a decode leg that could not be sent; "
                        "exponential backoff from 1 ms, none after HTTP 4xx (default 3)")
    add_log_arguments(p)
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    config = RouterConfig(
        decode=_backends(args.decode, "d", "--decode"),
        prefill=_backends(args.prefill, "p", "--prefill"),
        policy=args.policy,
        max_body_bytes=args.max_body_bytes,
        max_connections=args.max_connections,
        retries=args.prefill_retries,
    )
    config.active_config()  # validates (one-line errors)
    return config


def run(args: argparse.Namespace) -> int:
    def body() -> None:
        config = config_from_args(args)
        start_logging(PROG, args)
        router_app.run(config, args.host, args.port)

    return run_reporting(PROG, body)

"""`shadow tap`: the data plane — in-path taps in front of upstream workers, alone in a process of
their own that outlives every analysis.

Point the existing router at the printed tap URLs instead of the workers (or, in front mode
(`--front`), clients at a tap in front of the router). The taps only relay and keep a copy of each
request's bytes until an analysis has it: `shadow serve --attach DIR` (or `shadow serve` with the
same --upstream flags, which starts or adopts a group like this itself) attaches, gets a snapshot
of the requests in flight, then every copy as it happens. An analysis that dies, lags or restarts
changes nothing for the traffic.

One line `{"taps": {NAME: url}, "metrics": url, "attach": "unix:PATH", "dir": DIR, "pid": N}` is
printed when the taps accept. The group lives in STATE_DIR/taps/NAME (record, attach socket,
control socket; mode 0700). `/metrics` and `/health` of the data plane are on --metrics-port.

Taps relay the inference API only (/v1/*, /health, /metrics, /version, /tokenize, ...; extend with
--allow-path); malformed or ambiguous HTTP/1.1 gets 400 and is never forwarded; a stream the
upstream cuts reaches the client as an SSE error event and an aborted body, never a clean end.

Lifecycle. This process holds the listening sockets; a relay process serves them. A relay that
dies is replaced at once (its own streams are cut; new connections wait in the socket's queue,
none is refused). `shadow tap --reload` (or SIGHUP) starts a relay from the code installed now
and lets the old one finish its streams: the upgrade command, 0 refused, 0 cut. SIGTERM/SIGINT or
`shadow tap --stop`: stop accepting (a new connection is refused at once, so a router can retry it
elsewhere), let in-flight streams finish (--drain-timeout), exit; a second signal ends them at
once. If this process is killed (kill -9), its relays drain and end with it; `--status` then says
the supervisor is gone, and the next `shadow tap` of the name takes the group over on the ports it
had. Under systemd the listening sockets can come from socket activation (LISTEN_FDS, named after
the taps, `metrics` and `attach`).

The state directory and the group directories must be yours and writable by no one else (shadow
creates them 0700 and refuses, naming the path, one another user could change).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from shadow.app import tap as tap_app
from shadow.base.knobs import add_knobs, knob_values
from shadow.commands._flags import Flag, add_flags, fields, flag
from shadow.commands._help import add_command, run_alone
from shadow.commands._service import add_log_arguments, run_reporting, start_logging
from shadow.dataplane.http1 import DEFAULT_ALLOW_PATHS, TapLimits
from shadow.dataplane.relay import RelayBounds
from shadow.mirror.groups import BOUND_FLAG

PROG = "shadow tap"
SUMMARY = "the data plane: in-path taps, in a process that outlives the analysis"
log = logging.getLogger("shadow.tap")


def pairs(values: Sequence[str] | None, what: str, prog: str = PROG) -> dict[str, str]:
    """NAME=URL flags as {name: url} (SystemExit with one line on a bad one)."""
    out: dict[str, str] = {}
    for v in values or ():
        name, sep, url = v.partition("=")
        if not sep or not name or not url:
            raise SystemExit(f"{prog}: {what} must be NAME=URL, got {v!r}")
        if name in out:
            raise SystemExit(f"{prog}: {what} name {name!r} given twice")
        out[name] = url
    return out


def data_plane_flags() -> tuple[Flag, ...]:
    """The taps, shared by `shadow tap` and `shadow serve`; `fills` names the field of both
    `TapGroupConfig` and `MirrorConfig`. The relay's bounds and the taps' limits are declared on
    `RelayBounds` and `TapLimits` (`shadow.base.knobs`; `add_data_plane_arguments`)."""
    pair = {"action": "append", "metavar": "NAME=URL"}
    return (
        flag("--upstream", None, "a decode (or plain) worker to put a tap in front of; repeatable", **pair),
        flag("--front", None, "front mode: a pass-through tap in front of the router itself (point clients "
             "at it); the decode worker is read from the decision the router exposes (vllm-router P/D ids)",
             **pair),
        flag("--prefill", None, "a prefill worker (P/D) to put a tap in front of; repeatable", **pair),
        flag("--host", "host", "bind address (default 127.0.0.1)", default="127.0.0.1"),
        flag("--allow-path", None, "relay this path too (a trailing / makes it a prefix); repeatable. "
             "Default list: " + " ".join(DEFAULT_ALLOW_PATHS), action="append", metavar="PATH", default=[]),
        flag("--drain-timeout", "drain_timeout_s", "on stop, wait this long for in-flight requests to "
             "finish (default 30)", type=float, default=30.0, metavar="S"),
        flag("--state-dir", "state_dir", "where tap groups (and the prompt-key secret) are kept: "
             "STATE_DIR/taps/NAME; default $SHADOW_STATE_DIR, systemd's $STATE_DIRECTORY, else "
             "$XDG_STATE_HOME/shadow or ~/.local/state/shadow", metavar="DIR"),
    )


def group_flags() -> tuple[Flag, ...]:
    """`shadow tap`'s own options after the data plane's (built per call: a default comes from the
    environment)."""
    return (
        flag("--port", "port", "the first tap's port; the others take the following ones (default 0: "
             "ephemeral)", type=int, default=0),
        flag("--name", "name", "the tap group's name (its directory under STATE_DIR/taps; default: the tap "
             "names)", metavar="NAME"),
        flag("--metrics-port", "metrics_port", "port of this data plane's /metrics and /health (default 0: "
             "a free one, printed)", type=int, default=0),
        flag("--attach-listen", "attach_listen", "also accept an analysis over TCP here (another node); "
             "needs --attach-token. The unix socket in the group's directory is always there",
             metavar="HOST:PORT"),
        flag("--attach-token", "attach_token", "token an analysis attaching over TCP must prove it holds, "
             "as this group proves it to the analysis; it is never sent (env SHADOW_ATTACH_TOKEN)",
             default=os.environ.get("SHADOW_ATTACH_TOKEN")),
        flag("--digest", "digest", argparse.SUPPRESS),  # set by `shadow serve` for the groups it starts
        # set by `shadow serve` for a group in a temporary state directory: stop when stdin ends
        flag(BOUND_FLAG, "bound", argparse.SUPPRESS, action="store_true"),
    )


def add_data_plane_arguments(p: argparse._ActionsContainer) -> None:
    add_flags(p, data_plane_flags())
    add_knobs(p, RelayBounds)
    add_knobs(p, TapLimits)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_data_plane_arguments(p)
    add_flags(p, group_flags())
    add_log_arguments(p)
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--reload",
        action="store_true",
        help="tell the running group (--name, --state-dir) to start a relay from the code installed "
        "now and let the old one finish its streams (the upgrade command); prints its answer",
    )
    g.add_argument(
        "--stop",
        action="store_true",
        help="tell the running group to drain and exit (every group in the state dir with --all)",
    )
    g.add_argument("--status", action="store_true", help="print the running group's status (JSON)")
    p.add_argument("--all", action="store_true", help="with --stop or --status: every group in the state dir")


EPILOG = """examples:
  # taps in front of two decode workers and a prefill server; point the router at the printed URLs
  shadow tap --upstream d0=http://127.0.0.1:18100 --upstream d1=http://127.0.0.1:18101 \\
             --prefill p0=http://127.0.0.1:18000 --name fleet
  # the analysis attaches (and re-attaches after its own restart, kill -9 included)
  shadow serve --attach ~/.local/state/shadow/taps/fleet --slots 16 \\
             --upstream d0=http://127.0.0.1:18100 --upstream d1=http://127.0.0.1:18101 \\
             --prefill p0=http://127.0.0.1:18000
  shadow tap --reload --name fleet                  # upgrade: 0 refused connections, 0 cut streams
  shadow tap --stop --name fleet                    # drain and exit
"""


def register(subparsers: Any) -> None:
    add_command(subparsers, "tap", SUMMARY, __doc__, EPILOG, run, add_arguments)


def limits_from_args(args: argparse.Namespace) -> TapLimits:
    return TapLimits(**knob_values(args, TapLimits), allow_paths=DEFAULT_ALLOW_PATHS + tuple(args.allow_path))


def config_from_args(args: argparse.Namespace) -> tap_app.TapGroupConfig:
    if not args.upstream and not args.front and not args.prefill:
        print(f"{PROG}: give --upstream NAME=URL (in-path taps) or --front NAME=URL (front mode)",
              file=sys.stderr)
        raise SystemExit(2)  # a usage error, as argparse's
    return tap_app.TapGroupConfig(
        **fields(args, data_plane_flags()),
        **knob_values(args, RelayBounds),
        **fields(args, group_flags()),
        upstreams=pairs(args.upstream, "--upstream"),
        prefill=pairs(args.prefill, "--prefill"),
        front=pairs(args.front, "--front"),
        limits=limits_from_args(args),
    )


def _command(args: argparse.Namespace) -> int:
    cmd = "reload" if args.reload else "stop" if args.stop else "status"
    try:
        answers = tap_app.command(cmd, args.state_dir, args.name, every=args.all)
    except (ValueError, OSError) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1
    for doc in answers:
        print(json.dumps(doc), flush=True)
    return 0 if all(d.get("ok") for d in answers) else 1


def run(args: argparse.Namespace) -> int:
    if args.reload or args.stop or args.status:
        return _command(args)

    def body() -> None:
        config = config_from_args(args)
        start_logging(PROG, args)
        tap_app.run(config)

    return run_reporting(PROG, body)


def main(argv: Sequence[str] | None = None) -> int:
    return run_alone(PROG, __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())

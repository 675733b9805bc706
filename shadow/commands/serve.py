"""`shadow serve`: the sidecar — the mirror of `shadow tap` plus live counterfactual lanes.

Takes every `shadow tap` option (taps, front mode, event API, --forward from other tap
processes) and runs, beside the router, one lane with the router's real placements (`actual`)
and one lane per policy, fed as the mirrored requests happen. Prints one JSON line
`{"taps": {NAME: url}, "api": url}` when ready; the API serves /v1/report, /metrics, /v1/state,
/v1/events. SIGINT/SIGTERM stop it.

Configuration, later sources winning: defaults < YAML file (--config, env SHADOW_SERVE_CONFIG)
< environment (SHADOW_SERVE_<OPTION>, e.g. SHADOW_SERVE_LAG=5, SHADOW_SERVE_UPSTREAM=d0=URL,d1=URL)
< command-line flags. YAML keys are the option names (`lag: 5`, `slots: 64`,
`upstream: {d0: "http://..."}` or a list of NAME=URL, `policies: [jsq-bytes, br0]`).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import socket
import sys
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

from shadow.active.canary import CanaryConfig
from shadow.active.cohorts import ClientConfig
from shadow.active.fallback import GuardConfig
from shadow.active.modes import ModeConfig
from shadow.active.proxy import ActiveConfig
from shadow.app import serve as serve_app
from shadow.app.serve import ActiveSettings, LeaseSettings, ServeConfig, check_policies
from shadow.base.knobs import add_knobs, knob_values
from shadow.commands import tap as tap_cmd
from shadow.commands._flags import Flag, add_flags, fields, flag
from shadow.commands._layered import explicit_only, given, origin, resolve
from shadow.commands._service import add_log_arguments, run_reporting, start_logging
from shadow.commands.serve_checks import canary_steps, check_start_values
from shadow.core.policies import ACTIVE, active_names, active_policy, lane_names
from shadow.dataplane.http1 import TapLimits
from shadow.dataplane.relay import RelayBounds
from shadow.live.lanes import DEFAULT_POLICIES
from shadow.mirror.config import MirrorConfig
from shadow.mirror.keys import key_location, open_secret

PROG = "shadow serve"
ENV_PREFIX = "SHADOW_SERVE_"
log = logging.getLogger("shadow.serve")

EPILOG = """examples:
  # a simulated fleet of 4 decode ranks x 16 slots, taps in front of each, live lanes:
  shadow fleet --decode 4 --slots 16 --port 18000
  shadow serve --upstream d0=http://127.0.0.1:18100 --upstream d1=http://127.0.0.1:18101 \\
               --upstream d2=http://127.0.0.1:18102 --upstream d3=http://127.0.0.1:18103 --slots 16
  curl -s http://127.0.0.1:PORT/v1/report          # the lanes now; ?drain=1 at the end of a session

  # beside vllm-router in P/D mode (front mode), configured from a file:
  shadow serve --config serve.yaml --front router=http://127.0.0.1:8000

  # active routing modes (see "modes and fallback" below): start in canary with 10% of requests
  # routed by shadow, a watched flag file, and the admin API behind a token from a file:
  shadow serve --config serve.yaml --active --mode canary --canary-fraction 0.1 \\
               --mode-file /etc/shadow/mode.yaml --admin-token-file /etc/shadow/admin.token
  echo 'mode: active' > /etc/shadow/mode.yaml.new && mv /etc/shadow/mode.yaml.new /etc/shadow/mode.yaml
  curl -s -X PUT -H "Authorization: Bearer $(cat /etc/shadow/admin.token)" \\
       -d '{"mode": "active", "policy": "br0", "pin": false}' http://127.0.0.1:PORT/v1/mode
  curl -s http://127.0.0.1:PORT/v1/mode             # current mode, fallback reason, transitions

  # two tap processes forward their events here (each: shadow tap ... --forward API_URL):
  shadow serve --worker d0=http://10.0.0.5:8000 --worker d1=http://10.0.0.6:8000 --slots 256
"""




def attach_flags() -> tuple[Flag, ...]:
    """Where the analysis finds its tap groups (built per call: a default comes from the environment)."""
    return (
        flag("--attach", None, "attach to a running tap group (`shadow tap`: its directory "
             "STATE_DIR/taps/NAME, its attach socket, or its --attach-listen address) instead of starting "
             "one; repeatable (e.g. one per worker node). The --upstream/--prefill/--front flags still name "
             "the taps", action="append", metavar="DIR|unix:PATH|tcp://HOST:PORT"),
        flag("--attach-token", "attach_token", "the token of the tap groups attached over TCP: the relay "
             "and this analysis prove to each other that they hold it, and it is never sent (env "
             "SHADOW_ATTACH_TOKEN)", default=os.environ.get("SHADOW_ATTACH_TOKEN")),
        flag("--tap-group", "group", "name of the tap group this process starts or adopts (default "
             "serve-<digest of the tap configuration>)", metavar="NAME"),
        flag("--stop-taps", "stop_taps", "stop the tap group this process started when it exits (default: "
             "leave it serving, so that the router keeps working across restarts and upgrades of this "
             "process)", action="store_true"),
        flag("--relay", None, "'process' = the taps in a tap group of their own that outlives this process "
             "(default); 'thread' = in this process (the taps go down with it; for a single-process trial)",
             choices=("process", "thread"), default="process"),
        flag("--capture", "capture", "passive mode: read the traffic to the --upstream/--prefill/--front "
             "servers off this interface (needs root or CAP_NET_RAW) instead of relaying it; nothing in the "
             "path", metavar="IFACE"),
    )


def mirror_flags() -> tuple[Flag, ...]:
    """The analysis' own options: what it reads and records, its bounds (built per call: defaults
    come from the environment)."""
    pair = {"action": "append", "metavar": "NAME=URL"}
    return (
        flag("--worker", None, "front mode: a decode worker behind the router (named in its decisions; "
             "/metrics reconciled)", **pair),
        flag("--metrics-of", None, "where NAME's Prometheus metrics are (default: its upstream URL + "
             "/metrics)", **pair),
        flag("--record", "record", "record the session compactly (one line per request, step aggregates; "
             "gzip if FILE ends in .gz); `shadow replay FILE` replays it", metavar="FILE"),
        flag("--slots", "slots", "decode slots per worker", type=int, default=None),
        flag("--forward", "forward_to", "also POST every event to another shadow's event API",
             metavar="URL"),
        flag("--forward-token", "forward_token", "bearer token for --forward posts (env "
             "SHADOW_FORWARD_TOKEN); failures are counted in shadow_mirror_forward_errors_total",
             default=os.environ.get("SHADOW_FORWARD_TOKEN")),
        flag("--key-file", None, "secret for prompt keys (HMAC, hex), created when missing, or a mounted "
             "Secret; default $SHADOW_KEY_FILE, else STATE_DIR/prompt-key. Named (flag, env, state dir) and "
             "not creatable: exit 1; the default location not writable: a fresh in-memory secret and a "
             "warning", metavar="FILE"),
        flag("--events-token", "events_token", "bearer token required by POST /v1/events (env "
             "SHADOW_EVENTS_TOKEN); without one, event ingestion is refused unless the API listens on "
             "loopback, and everywhere in a serve with an admin token (events can trip its mode)",
             default=os.environ.get("SHADOW_EVENTS_TOKEN")),
        flag("--probe-token", "probe_token", "bearer token that admits `step` lines only on POST /v1/events "
             "(env SHADOW_PROBE_TOKEN, the one shadow's vLLM probe sends): the engine probe's, which moves "
             "the live lanes' clock and nothing else; the --events-token admits steps too (default: none, "
             "steps are admitted as the other events are)", default=os.environ.get("SHADOW_PROBE_TOKEN")),
    )


def add_mirror_arguments(p: argparse.ArgumentParser) -> None:
    """The analysis' options: its API port, its tap groups, the mirror."""
    add_flags(p.add_argument_group("the data plane (tap groups)"), attach_flags())
    mirror = p.add_argument_group("the mirror (and its API)")
    add_flags(mirror, mirror_flags())
    add_knobs(mirror, MirrorConfig)


def tap_config_from_args(args: argparse.Namespace) -> MirrorConfig:
    """The mirror's configuration (taps, attachments, bounds) from serve's options."""
    if not args.upstream and not args.front and not getattr(args, "worker", None):
        print(f"{PROG}: give --upstream NAME=URL (in-path taps) or --front NAME=URL (front mode)",
              file=sys.stderr)
        raise SystemExit(2)  # a usage error, as argparse's
    return MirrorConfig(
        **fields(args, tap_cmd.data_plane_flags()),
        **knob_values(args, RelayBounds),
        **knob_values(args, TapLimits),
        **fields(args, attach_flags()),
        **fields(args, mirror_flags()),
        **knob_values(args, MirrorConfig),
        upstreams=tap_cmd.pairs(args.upstream, "--upstream", PROG),
        prefill=tap_cmd.pairs(args.prefill, "--prefill", PROG),
        front=tap_cmd.pairs(args.front, "--front", PROG),
        workers=tap_cmd.pairs(args.worker, "--worker", PROG),
        metrics_of=tap_cmd.pairs(args.metrics_of, "--metrics-of", PROG),
        allow_paths=tuple(args.allow_path),
        key_secret=open_secret(key_location(args.key_file, args.state_dir, os.environ), log.warning),
        relay="thread" if args.capture else args.relay,
        attach=tuple(args.attach or ()),
    )


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("live lanes")
    g.add_argument(
        "--config",
        metavar="FILE.yaml",
        help="YAML file of options (keys = option names); flags and SHADOW_SERVE_* override it",
    )
    g.add_argument(
        "--policies",
        default=",".join(DEFAULT_POLICIES),
        help=f"comma-separated lanes beside `actual`: {lane_names()} (default {','.join(DEFAULT_POLICIES)})",
    )
    add_knobs(g, ServeConfig)  # the lanes' settings, declared on ServeConfig


#: The canary analysis' steps (its other settings are declared on `CanaryConfig`).
CANARY_FLAGS = (
    flag("--canary-steps", None, "analysed canary: comma-separated increasing fractions (e.g. "
         "0.01,0.05,0.25); mode canary then runs each step, promoted to the next (and after the last to "
         "active) only when the canary cohort is no worse than the router cohort, else back to shadow with "
         "the reason (default: none, canary stays at --canary-fraction)", metavar="F,F,..."),
)


def add_mode_arguments(p: argparse.ArgumentParser) -> None:
    """The mode controller's flags: modes, the admin API, automatic fallback."""
    g = p.add_argument_group(
        "modes and fallback",
        "Modes: shadow (the router routes), canary (a fixed fraction of request ids routed by shadow), "
        "active, fallback (round-robin). An invalid mode from any source means shadow (counted as "
        "flag_error); without --active only shadow can be carried out, and any other mode is refused "
        "(exit 2 at start, 409 from PUT /v1/mode, a flag error from the flag file). Automatic "
        "fallback to round-robin trips on a decision error, slow decisions, a worker down, upstream "
        "failures, stale telemetry or mirror drift, and recovers after a hold-down that doubles on "
        "repeated trips.",
    )
    g.add_argument("--mode", metavar="MODE",
                   help="mode at start: shadow, canary, active, fallback (default: with --active, shadow "
                   "when a --front router is there to pass requests to, else active; without --active, "
                   "shadow, the only mode it can carry out); canary and active run --active-policy")
    add_knobs(g, ModeConfig)
    g.add_argument("--admin-token", metavar="TOKEN",
                   help="bearer token of PUT /v1/mode (prefer --admin-token-file or the environment "
                   "SHADOW_SERVE_ADMIN_TOKEN: flags show in ps); without one, PUT /v1/mode is off")
    g.add_argument("--admin-token-file", metavar="FILE", help="read the admin token from FILE")
    add_knobs(g, GuardConfig)
    add_knobs(g, ClientConfig)
    add_flags(g, CANARY_FLAGS)
    add_knobs(g, CanaryConfig)


def mode_config_from_args(args: argparse.Namespace) -> ModeConfig | None:
    """The mode controller's configuration, or None when shadow serve runs without one."""
    token = getattr(args, "admin_token", None)
    token_file = getattr(args, "admin_token_file", None)
    if token and token_file:
        raise ValueError("give --admin-token or --admin-token-file, not both")
    if token_file:
        try:
            with open(token_file, encoding="utf-8") as fh:
                token = fh.read().strip()
        except OSError as exc:
            raise ValueError(f"--admin-token-file {token_file}: {exc.strerror or exc}") from None
        if not token:
            raise ValueError(f"--admin-token-file {token_file}: empty")
    if token is not None and len(token) < 16:
        raise ValueError("the admin token must be at least 16 characters")
    wanted = getattr(args, "active", False) or args.mode_file or token or args.mode or args.pin_mode
    if not wanted:
        return None
    guards = GuardConfig(**knob_values(args, GuardConfig), upstream_window_s=args.trip_window)
    guards.validate()
    clients = ClientConfig(**knob_values(args, ClientConfig))
    clients.validate()
    canary = CanaryConfig(steps=canary_steps(args), **knob_values(args, CanaryConfig))
    try:
        canary.validate()
    except ValueError as exc:
        raise ValueError(f"--canary-*: {exc}") from None
    active = getattr(args, "active", False)
    return ModeConfig(
        mode=str(args.mode or ("active" if active and not getattr(args, "front", None) else "shadow")),
        policy=str(getattr(args, "active_policy", "br0")),
        **knob_values(args, ModeConfig),
        admin_token=token,
        guards=guards,
        clients=clients,
        canary=canary,
        source=origin(args, "mode").split(" ")[0],
        source_detail=", ".join(f"{name} from {origin(args, dest)}" for name, dest in MODE_VALUES
                                if origin(args, dest) != "default"),
    )


#: The values of the mode at start: (name in the setting, option dest).
MODE_VALUES = (("mode", "mode"), ("policy", "active_policy"), ("canary_fraction", "canary_fraction"),
               ("pin", "pin_mode"))


def _active_policy(name: str) -> str:
    """`--active-policy`: the policy's name (an unknown or retired one: a usage error naming why)."""
    try:
        return active_policy(name)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


#: The active proxy's policy flag after --active, filling an `ActiveSettings` field; its listener's
#: flags are derived from `ActiveSettings`, its other settings' from `ActiveConfig` (`shadow.base.knobs`).
ACTIVE_FLAGS = (
    flag("--active-policy", "policy", f"policy of active mode ({active_names()}; brh with the survival "
         "predictor; jsq, JSQ-count, is not one: its old use here for jsq-bytes is refused) (default br0)",
         type=_active_policy, default="br0", metavar=f"{{{','.join(ACTIVE)}}}"),
)


#: Replicas' leader lease flags, each filling a `LeaseSettings` field (its key and TTL: knobs of it).
LEASE_FLAGS = (
    flag("--lease-etcd", "endpoint", "replicas: etcd's client URL (its v3 JSON gateway); only the holder of "
         "the leader lease routes, the others (standbys) pass every request to the --front router until "
         "the lease lapses and one of them takes it", metavar="URL"),
    flag("--replica-id", "holder", "this replica's name, in the lease and at the tap groups it attaches to: "
         "replicas attach side by side, each getting every copy, and one of the same name replaces its "
         "predecessor (default HOSTNAME-PID with --lease-etcd; else none: a new serve replaces the old)",
         metavar="NAME"),
)


def add_active_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of the active proxy (`--active`): its listener, policy and bounds."""
    g = p.add_argument_group("active routing (--active: the front listener is shadow's own P/D proxy)")
    g.add_argument("--active", action="store_true",
                   help="run shadow's own proxy as the client-facing listener: in mode shadow it passes "
                   "requests to the --front router, in active/fallback it routes the P/D flow itself "
                   "through the taps (its URL is `active` in the ready line)")
    add_flags(g, ACTIVE_FLAGS)
    add_knobs(g, ActiveSettings)
    add_knobs(g, ActiveConfig)
    lease = p.add_argument_group("replicas (leader lease)")
    add_flags(lease, LEASE_FLAGS)
    add_knobs(lease, LeaseSettings)


def lease_settings(args: argparse.Namespace) -> LeaseSettings | None:
    if not getattr(args, "lease_etcd", None):
        return None
    got = {**fields(args, LEASE_FLAGS), **knob_values(args, LeaseSettings)}
    if not got.get("holder"):
        got["holder"] = f"{socket.gethostname()}-{os.getpid()}"
    return LeaseSettings(**got)


def active_settings(args: argparse.Namespace) -> ActiveSettings | None:
    if not getattr(args, "active", False):
        return None
    return ActiveSettings(**fields(args, ACTIVE_FLAGS), **knob_values(args, ActiveSettings),
                          settings=knob_values(args, ActiveConfig))


def _parser(p: argparse.ArgumentParser, *, explicit: bool) -> argparse.ArgumentParser:
    """Every option of `shadow serve` on `p`; `explicit`: only the flags given are set (`run`
    fills in the file, the environment and the defaults)."""
    tap_cmd.add_data_plane_arguments(p)
    add_mirror_arguments(p)
    add_log_arguments(p)
    add_serve_arguments(p)
    add_mode_arguments(p)
    add_active_arguments(p)
    if explicit:
        explicit_only(p)

    def error(message: str) -> NoReturn:
        print(f"{PROG}: {message}", file=sys.stderr)
        raise SystemExit(2)

    p.error = error  # type: ignore[method-assign]
    return p


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    """The parser with every default (what YAML and the environment are read through)."""
    return _parser(argparse.ArgumentParser(prog=prog, description=__doc__, epilog=EPILOG,
                                           formatter_class=argparse.RawDescriptionHelpFormatter),
                   explicit=False)


def register(subparsers: Any) -> None:
    summary = "the sidecar: mirror a router (as `shadow tap`) and run live BR-0/BR-H lanes beside it"
    p = subparsers.add_parser("serve", help=summary, description=__doc__, epilog=EPILOG)
    _parser(p, explicit=True).set_defaults(func=run)


def resolve_args(explicit: Mapping[str, Any], environ: Mapping[str, str]) -> argparse.Namespace:
    """defaults < YAML < environment < explicit flags, parsed and typed by the same parser."""
    return resolve(build_parser, explicit, environ, ENV_PREFIX)


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    check_start_values(args)
    tap = tap_config_from_args(args)
    policies = tuple(p.strip() for p in str(args.policies).split(",") if p.strip())
    check_policies(policies)
    lease = lease_settings(args)
    name = lease.holder if lease is not None else getattr(args, "replica_id", None)
    if name:  # replicas attach to the same tap groups side by side, each under its name
        tap = dataclasses.replace(tap, analysis_name=name)
    return ServeConfig(
        tap=tap,
        policies=policies,
        **knob_values(args, ServeConfig),
        mode_config=mode_config_from_args(args),
        active=active_settings(args),
        drain_timeout_s=args.drain_timeout,
        lease=lease,
    )


def run(args: argparse.Namespace) -> int:
    def body() -> None:
        resolved = resolve_args(given(args), os.environ)
        config = config_from_args(resolved)
        config.validate()  # a bad value is one line, before the start-up line
        start_logging(PROG, resolved)
        serve_app.run(config)

    return run_reporting(PROG, body)


def main(argv: Sequence[str] | None = None) -> int:
    return run(_parser(argparse.ArgumentParser(prog=PROG), explicit=True).parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())

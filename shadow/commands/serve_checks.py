"""`shadow serve`'s start-up values checked before anything starts: a bad one is a ValueError of
one line naming the flag and where its value came from (the command exits 2 on it). Numbers,
ports, the addresses (NAME=URL, URL, tcp://HOST:PORT), --canary-steps and --policies."""

from __future__ import annotations

import argparse
from urllib.parse import urlsplit

from shadow.active.canary import CanaryConfig
from shadow.active.cohorts import ClientConfig
from shadow.active.fallback import GuardConfig
from shadow.active.modes import ModeConfig
from shadow.active.proxy import ActiveConfig
from shadow.app.serve import ActiveSettings, LeaseSettings, ServeConfig, check_policies
from shadow.base.knobs import NON_NEGATIVE_S, Bound, knob_rules
from shadow.commands._layered import origin
from shadow.contracts.frames import MAX_NAME
from shadow.contracts.modes import MODES
from shadow.dataplane.http1 import TapLimits
from shadow.dataplane.relay import RelayBounds
from shadow.mirror.attach import parse_address
from shadow.mirror.config import MirrorConfig

NO_ACTIVE = ("without --active the existing router routes every request, so only mode shadow can be "
             "carried out")

#: The configs whose fields declare `shadow serve`'s settings (`shadow.base.knobs`): the lanes', the
#: active proxy's, the mode controller's, the fallback's, the client-felt checks', the canary's, and
#: the data plane's (the relay's bounds and the taps' limits, shared with `shadow tap`) and the
#: mirror's (`MirrorConfig`; its `MirrorBounds` shared with `shadow capture`), the active listener's and
#: the leader lease's.
DECLARED: tuple[type, ...] = (ServeConfig, ActiveConfig, ModeConfig, GuardConfig, ClientConfig, CanaryConfig,
                              RelayBounds, TapLimits, MirrorConfig, ActiveSettings, LeaseSettings)

#: (option dest, bound) for the numbers: seconds, fractions and counts (those of the settings
#: DECLARED derived from their declarations).
NUMBERS: tuple[tuple[str, Bound], ...] = (
    *(rule for cls in DECLARED for rule in knob_rules(cls)),
    ("drain_timeout", NON_NEGATIVE_S),
)

#: The options naming upstreams as NAME=URL (repeatable), and those holding one URL.
PAIRS = ("upstream", "prefill", "front", "worker", "metrics_of")
URLS = ("forward", "lease_etcd")


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _named(args: argparse.Namespace, dest: str) -> str:
    """`--flag` and, when not given as a flag, where its value came from."""
    where = origin(args, dest)
    return _flag(dest) if where == "flag" else f"{_flag(dest)} (from {where})"


def _url_fault(url: str) -> str | None:
    """What keeps a client from connecting to `url` by its port (None: nothing)."""
    try:
        parts = urlsplit(url)
    except ValueError as exc:  # a broken [IPv6] host
        return str(exc)
    try:
        got = parts.port
    except ValueError:  # out of 0..65535, or not a number
        got = 0
    return "the port must be in 1..65535" if got == 0 else None


def check_addresses(args: argparse.Namespace) -> None:
    """ValueError naming the first NAME=URL, URL or --attach address shadow serve cannot use (a
    name may name one upstream of one kind; --metrics-of names them again)."""
    named: dict[str, str] = {}
    for dest in PAIRS:
        names = named if dest != "metrics_of" else {}
        for value in getattr(args, dest, None) or ():
            name, sep, url = str(value).partition("=")
            if not sep or not name or not url:
                raise ValueError(f"{_named(args, dest)} must be NAME=URL, got {value!r}")
            if name in names:
                again = "given twice" if names[name] == dest else f"also given by {_flag(names[name])}"
                raise ValueError(f"{_named(args, dest)} name {name!r} {again}")
            names[name] = dest
            fault = _url_fault(url)
            if fault is not None:
                raise ValueError(f"{_named(args, dest)} {value!r}: {fault}")
    for dest in URLS:
        value = getattr(args, dest, None)
        fault = _url_fault(str(value)) if value else None
        if fault is not None:
            raise ValueError(f"{_named(args, dest)} {value!r}: {fault}")
    for value in getattr(args, "attach", None) or ():
        kind, where = parse_address(str(value))
        if kind == "tcp" and not 1 <= where[1] <= 65535:
            raise ValueError(f"{_named(args, 'attach')} {value!r}: the port must be in 1..65535")
        if kind == "tcp" and not getattr(args, "attach_token", None):
            raise ValueError(f"{_named(args, 'attach')} {value!r}: attaching over TCP needs --attach-token "
                             "(or SHADOW_ATTACH_TOKEN), the tap group's")


def canary_steps(args: argparse.Namespace) -> tuple[float, ...]:
    """--canary-steps as fractions (ValueError naming the flag: not numbers, or not increasing
    fractions in (0, 1))."""
    text = getattr(args, "canary_steps", None)
    if not text:
        return ()
    try:
        steps = tuple(float(x) for x in str(text).split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{_named(args, 'canary_steps')} must be comma-separated fractions, got {text!r}"
                         ) from None
    try:
        CanaryConfig(steps=steps).validate()
    except ValueError:
        raise ValueError(f"{_named(args, 'canary_steps')} must be increasing fractions in (0, 1), got "
                         f"{text!r}") from None
    return steps


def check_start_values(args: argparse.Namespace) -> None:
    """ValueError naming the first flag whose value shadow serve cannot run with."""
    for dest, bound in NUMBERS:
        v = getattr(args, dest, None)
        if v is None or isinstance(v, bool):
            continue
        if not bound.ok(float(v)):
            raise ValueError(f"{_named(args, dest)} must be {bound.asks}, got {v}")
    check_addresses(args)
    canary_steps(args)
    policies = getattr(args, "policies", None)
    if policies is not None:
        try:
            check_policies(tuple(p.strip() for p in str(policies).split(",") if p.strip()))
        except ValueError as exc:
            raise ValueError(f"{_named(args, 'policies')}: {exc}") from None
    active = bool(getattr(args, "active", False))
    mode = getattr(args, "mode", None)
    if mode is not None:
        if mode not in MODES:
            raise ValueError(f"{_named(args, 'mode')} must be one of {', '.join(MODES)}, got {mode!r}")
        if mode != "shadow" and not active:
            raise ValueError(f"{_named(args, 'mode')} {mode} needs --active: {NO_ACTIVE}")
    if active and getattr(args, "scrape_interval", 1.0) == 0:
        raise ValueError(f"{_named(args, 'scrape_interval')} 0 turns reconciliation off, which would blind "
                         "the worker-down, drift and stale-telemetry fallback checks of --active: give a "
                         "positive interval")
    holddown, cap = getattr(args, "holddown", None), getattr(args, "holddown_max", None)
    if holddown is not None and cap is not None and cap < holddown:
        raise ValueError(
            f"{_named(args, 'holddown_max')} {cap} is below {_named(args, 'holddown')} {holddown}")
    least, most = getattr(args, "canary_min_step", None), getattr(args, "canary_max_step", None)
    if least is not None and most is not None and most < least:
        raise ValueError(f"{_named(args, 'canary_max_step')} {most} is below "
                         f"{_named(args, 'canary_min_step')} {least}")
    pause, resume = getattr(args, "kv_pause", None), getattr(args, "kv_resume", None)
    if pause is not None and resume is not None and resume > pause:
        raise ValueError(f"{_named(args, 'kv_resume')} {resume} is above {_named(args, 'kv_pause')} {pause}")
    rid = getattr(args, "replica_id", None)
    if rid is not None and not (0 < len(rid) <= MAX_NAME and rid.isprintable() and rid.strip() == rid):
        raise ValueError(f"{_named(args, 'replica_id')} must be 1 to {MAX_NAME} printable characters without "
                         f"surrounding spaces, got {rid[:99]!r}")

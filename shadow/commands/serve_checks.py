"""`shadow serve`'s start-up values checked before anything starts: a bad one is a ValueError of
one line naming the flag and where its value came from (the command exits 2 on it)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from shadow.commands._layered import origin
from shadow.contracts.modes import MODES

NO_ACTIVE = ("without --active the existing router routes every request, so only mode shadow can be "
             "carried out")

Rule = Callable[[float], bool]


def positive(v: float) -> bool:
    return math.isfinite(v) and v > 0


def non_negative(v: float) -> bool:
    return math.isfinite(v) and v >= 0


def fraction(v: float) -> bool:
    return math.isfinite(v) and 0 <= v <= 1


def open_fraction(v: float) -> bool:
    return math.isfinite(v) and 0 < v <= 1


def open_unit(v: float) -> bool:
    return math.isfinite(v) and 0 < v < 1


def over_one(v: float) -> bool:
    return math.isfinite(v) and v > 1


def at_least_one(v: float) -> bool:
    return v >= 1


def at_least_two(v: float) -> bool:
    return v >= 2


#: (option dest, rule, what the rule asks) for the numbers: seconds, fractions and counts.
NUMBERS: tuple[tuple[str, Rule, str], ...] = (
    ("scrape_interval", non_negative, ">= 0 s (0 = reconciliation off)"),
    ("ttl", positive, "> 0 s"),
    ("phantom_age", positive, "> 0 s"),
    ("header_timeout", positive, "> 0 s"),
    ("idle_timeout", positive, "> 0 s"),
    ("drain_timeout", non_negative, ">= 0 s"),
    ("queue_size", at_least_one, ">= 1"),
    ("max_connections", at_least_one, ">= 1"),
    ("canary_fraction", fraction, "a fraction in [0, 1]"),
    ("mode_file_interval", positive, "> 0 s"),
    ("mode_check_interval", positive, "> 0 s"),
    ("oracle_interval", non_negative, ">= 0 s (0 = off)"),
    ("decision_budget", positive, "> 0 s"),
    ("trip_slow_count", at_least_one, ">= 1"),
    ("trip_window", positive, "> 0 s"),
    ("trip_drift", positive, "> 0 requests"),
    ("trip_stale", positive, "> 0 s"),
    ("trip_upstream_error_rate", open_fraction, "a fraction in (0, 1]"),
    ("trip_upstream_min_calls", at_least_one, ">= 1"),
    ("holddown", positive, "> 0 s"),
    ("holddown_max", positive, "> 0 s"),
    ("pool_ttl", positive, "> 0 s"),
    ("transfer_cap", at_least_one, ">= 1"),
    ("dispatch_ahead", non_negative, ">= 0"),
    ("kv_pause", open_fraction, "a fraction in (0, 1]"),
    ("trip_client_error_rate", open_fraction, "a fraction in (0, 1]"),
    ("trip_client_min_requests", at_least_one, ">= 1"),
    ("trip_client_window", positive, "> 0 s"),
    ("trip_slo_ratio", over_one, "> 1"),
    ("trip_slo_min_requests", at_least_one, ">= 1"),
    ("canary_min_requests", at_least_two, ">= 2"),
    ("canary_min_step", positive, "> 0 s"),
    ("canary_max_step", positive, "> 0 s"),
    ("canary_alpha", open_unit, "in (0, 1)"),
    ("canary_error_margin", non_negative, ">= 0"),
    ("canary_ttft_margin", non_negative, ">= 0"),
    ("canary_tpot_margin", non_negative, ">= 0"),
    ("kv_resume", open_fraction, "a fraction in (0, 1]"),
)


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _named(args: argparse.Namespace, dest: str) -> str:
    """`--flag` and, when not given as a flag, where its value came from."""
    where = origin(args, dest)
    return _flag(dest) if where == "flag" else f"{_flag(dest)} (from {where})"


def check_start_values(args: argparse.Namespace) -> None:
    """ValueError naming the first flag whose value shadow serve cannot run with."""
    for dest, ok, asks in NUMBERS:
        v = getattr(args, dest, None)
        if v is None or isinstance(v, bool):
            continue
        if not ok(float(v)):
            raise ValueError(f"{_named(args, dest)} must be {asks}, got {v}")
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
    pause, resume = getattr(args, "kv_pause", None), getattr(args, "kv_resume", None)
    if pause is not None and resume is not None and resume > pause:
        raise ValueError(f"{_named(args, 'kv_resume')} {resume} is above {_named(args, 'kv_pause')} {pause}")

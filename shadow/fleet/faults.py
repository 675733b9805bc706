"""Fault injection: the settings grammar (CLI and JSON) and the per-server fault state.

One grammar for both sources. JSON for `POST /fleet/faults` is an object of settings, with an
optional `"target": "decode/1"` (default: the server receiving it; `"decode/*"` for all ranks).
The CLI form is `--fault TARGET:key=value[,key=value...][@AT]`, e.g. `decode/0:stall_s=2@5`
(apply 5 wall seconds after start). Keys (durations in wall seconds):

  stall_s=S       steps (decode; the barrier stalls every rank) or prefills stop for S seconds
  crash_s=S       stop listening, drop connections and in-flight requests; recover after S
                  seconds (S <= 0: stay down until `recover`)
  recover=true    bring a crashed server back (send it to another server with a target)
  slow=X          multiply this server's compute time per step / per prefill by X
  http_status=N   answer generation requests with status N (4xx/5xx) before any work ...
  http_count=K    ... for the next K requests only (default: until cleared)
  cut_after=K     streaming responses: close the connection after K data events
  error_after=K   streaming responses: after K data events send a vLLM error event, then [DONE]
  dup_every=K     streaming responses: send every K-th token chunk twice
  drop_every=K    streaming responses: never send every K-th token chunk
  clear=true      reset all faults of the server (not a crash)

Stream faults are snapshotted when a request arrives; K = 0 disables a stream fault.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

_FLOAT_KEYS = ("stall_s", "crash_s", "slow")
_INT_KEYS = ("http_status", "http_count", "cut_after", "error_after", "dup_every", "drop_every")
_BOOL_KEYS = ("recover", "clear")
FAULT_KEYS = frozenset(_FLOAT_KEYS + _INT_KEYS + _BOOL_KEYS)
ROLES = ("prefill", "decode")


@dataclass(frozen=True, slots=True)
class Target:
    """A server of the fleet (`index` None = every server of that role)."""

    role: str
    index: int | None

    @classmethod
    def parse(cls, text: str) -> Target:
        role, sep, idx = text.strip().partition("/")
        if role not in ROLES or not sep or not idx:
            raise ValueError(
                f"fault target must look like 'decode/1', 'prefill/0' or 'decode/*', got {text!r}"
            )
        if idx == "*":
            return cls(role, None)
        if not idx.isdigit():
            raise ValueError(f"fault target index must be a number or '*', got {text!r}")
        return cls(role, int(idx))

    def __str__(self) -> str:
        return f"{self.role}/{'*' if self.index is None else self.index}"


@dataclass(frozen=True, slots=True)
class FaultSpec:
    """Settings to apply to `target`, `at_s` wall seconds after the fleet started."""

    target: Target
    settings: tuple[tuple[str, float | int | bool], ...]
    at_s: float = 0.0

    @classmethod
    def parse(cls, text: str) -> FaultSpec:
        """Parse the CLI form `TARGET:key=value[,key=value...][@AT]`."""
        body, _, at = text.partition("@")
        target_text, sep, kvs = body.partition(":")
        if not sep or not kvs:
            raise ValueError(f"fault must look like 'decode/0:stall_s=2[@5]', got {text!r}")
        raw: dict[str, Any] = {}
        for item in kvs.split(","):
            key, eq, value = item.partition("=")
            if not eq:
                raise ValueError(f"fault setting must be key=value, got {item!r}")
            raw[key.strip()] = value.strip()
        at_s = float(at) if at else 0.0
        if not (math.isfinite(at_s) and at_s >= 0):
            raise ValueError(f"fault time must be >= 0, got {at!r}")
        settings = validate_settings(raw)
        return cls(Target.parse(target_text), tuple(settings.items()), at_s)


def _as_bool(key: str, v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        return v.lower() in ("1", "true", "yes", "on")
    raise ValueError(f"fault setting {key} must be a boolean, got {v!r}")


def validate_settings(raw: dict[str, Any]) -> dict[str, float | int | bool]:
    """Check keys and types of a settings object (strings are converted); raise ValueError."""
    out: dict[str, float | int | bool] = {}
    for key, v in raw.items():
        if key not in FAULT_KEYS:
            raise ValueError(f"unknown fault setting {key!r}; known: {', '.join(sorted(FAULT_KEYS))}")
        if key in _BOOL_KEYS:
            out[key] = _as_bool(key, v)
            continue
        if isinstance(v, bool):
            raise ValueError(f"fault setting {key} must be a number, got {v!r}")
        try:
            num = float(v)
        except (TypeError, ValueError):
            raise ValueError(f"fault setting {key} must be a number, got {v!r}") from None
        if not math.isfinite(num):
            raise ValueError(f"fault setting {key} must be finite, got {v!r}")
        if key in _INT_KEYS:
            if num != int(num) or num < 0:
                raise ValueError(f"fault setting {key} must be an integer >= 0, got {v!r}")
            out[key] = int(num)
        else:
            out[key] = num
    status = out.get("http_status")
    if status and not (400 <= int(status) <= 599):
        raise ValueError(f"http_status must be a 4xx/5xx status, got {status}")
    if "slow" in out and float(out["slow"]) <= 0:
        raise ValueError("slow must be > 0")
    if "stall_s" in out and float(out["stall_s"]) < 0:
        raise ValueError("stall_s must be >= 0")
    return out


@dataclass(frozen=True, slots=True)
class StreamFaults:
    """Stream faults in force when a request arrived (0 = off)."""

    cut_after: int = 0
    error_after: int = 0
    dup_every: int = 0
    drop_every: int = 0

    @property
    def any(self) -> bool:
        return bool(self.cut_after or self.error_after or self.dup_every or self.drop_every)


NO_STREAM_FAULTS = StreamFaults()


class FaultState:
    """The mutable faults of one server (crash is handled by the server itself)."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.stall_until = 0.0  # event-loop time
        self.slow = 1.0
        self.http_status = 0
        self.http_remaining = -1  # -1: unlimited
        self.stream = NO_STREAM_FAULTS

    def apply(self, settings: dict[str, float | int | bool], now: float) -> None:
        """Apply validated settings at event-loop time `now` (crash/recover are ignored here)."""
        if settings.get("clear"):
            self.clear()
        if "stall_s" in settings:
            self.stall_until = now + float(settings["stall_s"])
        if "slow" in settings:
            self.slow = float(settings["slow"])
        if "http_status" in settings:
            self.http_status = int(settings["http_status"])
            self.http_remaining = int(settings.get("http_count", -1)) if self.http_status else -1
        elif "http_count" in settings:
            self.http_remaining = int(settings["http_count"])
        s = self.stream
        self.stream = StreamFaults(
            cut_after=int(settings.get("cut_after", s.cut_after)),
            error_after=int(settings.get("error_after", s.error_after)),
            dup_every=int(settings.get("dup_every", s.dup_every)),
            drop_every=int(settings.get("drop_every", s.drop_every)),
        )

    def take_http_error(self) -> int:
        """Status to fail the next generation request with, or 0 (consumes one of http_count)."""
        if not self.http_status or self.http_remaining == 0:
            return 0
        if self.http_remaining > 0:
            self.http_remaining -= 1
        return self.http_status

    def stalled(self, now: float) -> bool:
        return self.stall_until > now

    def to_json(self, now: float) -> dict[str, Any]:
        return {
            "stall_remaining_s": max(0.0, self.stall_until - now),
            "slow": self.slow,
            "http_status": self.http_status,
            "http_count": self.http_remaining,
            "cut_after": self.stream.cut_after,
            "error_after": self.stream.error_after,
            "dup_every": self.stream.dup_every,
            "drop_every": self.stream.drop_every,
        }

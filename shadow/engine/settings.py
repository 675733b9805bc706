"""What a set of lanes ran with, as a recording's header carries it: enough to run them again.

`LaneSettings.to_json()` is what `shadow serve --record` writes; `from_json` reads it back (a
ValueError names the bad field); `differences` lists how another setting departs from it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from shadow.core.params import BRParams
from shadow.core.stepmodel import StepTimeModel
from shadow.engine.config import LaneClock, LaneSpec
from shadow.engine.rolling import check_window

#: Where the lanes' step model came from: given to the sidecar, or its built-in default.
STEP_ORIGINS = ("configured", "default")
#: The clock the live lanes stepped on: `configured` (the step model above) or `measured` (per-worker
#: step models fitted live: a recording carries them as `clock` lines, `clock_to_json`).
CLOCKS = ("configured", "measured")
#: A step model's terms in a `clock` line: [a, b, c, p] per worker.
TERMS = ("a", "b", "c", "p")


@dataclass(frozen=True, slots=True)
class LaneSettings:
    """Policies (lane specs, `actual` not among them), the step model the lanes simulated (its cost
    model: the per-sequence and prefill terms are written where they are not 0) and where
    it came from (`configured`: given to the sidecar; `default`: its built-in model), slots per
    worker, lag, BR parameters and the seed of random policies."""

    policies: tuple[str, ...]
    step: StepTimeModel
    slots: int
    step_origin: str = "configured"  # one of STEP_ORIGINS (the file key is `step.source`)
    lag_s: float = 0.0
    br: BRParams = field(default_factory=BRParams)
    seed: int = 0
    rolling_s: float | None = None  # re-seeded from the mirrored fleet every this many seconds
    clock: str = "configured"  # one of CLOCKS

    def __post_init__(self) -> None:
        if not self.policies:
            raise ValueError("policies: none given")
        for p in self.policies:
            LaneSpec.parse(p)
        if self.step_origin not in STEP_ORIGINS:
            raise ValueError(f"step origin must be one of {STEP_ORIGINS}, got {self.step_origin!r}")
        if isinstance(self.slots, bool) or not isinstance(self.slots, int) or self.slots < 1:
            raise ValueError(f"slots must be an integer >= 1, got {self.slots!r}")
        if not (math.isfinite(self.lag_s) and self.lag_s >= 0):
            raise ValueError(f"lag must be a finite number >= 0, got {self.lag_s!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        check_window(self.rolling_s)
        if self.clock not in CLOCKS:
            raise ValueError(f"clock must be one of {CLOCKS}, got {self.clock!r}")

    def to_json(self) -> dict[str, Any]:
        step: dict[str, Any] = {"a_s_per_token": self.step.a, "b_s": self.step.b, "source": self.step_origin}
        if not self.step.linear:  # the cost model's per-sequence and prefill terms (absent: 0)
            step |= {"c_s_per_seq": self.step.c, "p_s_per_prefill_token": self.step.p}
        out = {
            "policies": list(self.policies),
            "step": step,
            "slots": self.slots,
            "lag_s": self.lag_s,
            "br": asdict(self.br),
            "seed": self.seed,
        }
        if self.rolling_s is not None:
            out["rolling_s"] = self.rolling_s
        if self.clock != "configured":
            out["clock"] = self.clock
        return out

    @classmethod
    def from_json(cls, obj: object) -> LaneSettings:
        """Parse `to_json()`'s output; ValueError (one line) on anything else."""
        if not isinstance(obj, Mapping):
            raise ValueError("lanes: must be an object")
        try:
            policies, step = obj["policies"], obj["step"]
            if not isinstance(policies, list) or not all(isinstance(p, str) for p in policies):
                raise ValueError("policies must be a list of lane specs")
            if not isinstance(step, Mapping):
                raise ValueError("step must be an object")
            a, b = step["a_s_per_token"], step["b_s"]
            c, p = step.get("c_s_per_seq", 0.0), step.get("p_s_per_prefill_token", 0.0)
            lag = obj.get("lag_s", 0.0)
            for name, v in (("step a", a), ("step b", b), ("step c", c), ("step p", p), ("lag_s", lag)):
                if isinstance(v, bool) or not isinstance(v, int | float):
                    raise ValueError(f"{name} must be a number")
            rolling = obj.get("rolling_s")
            if rolling is not None and (isinstance(rolling, bool) or not isinstance(rolling, int | float)):
                raise ValueError("rolling_s must be a number")
            br = obj.get("br", {})
            if not isinstance(br, Mapping):
                raise ValueError("br must be an object")
            return cls(
                policies=tuple(policies),
                step=StepTimeModel(float(a), float(b), float(c), float(p)),
                slots=obj["slots"],
                step_origin=step.get("source", "configured"),
                lag_s=float(obj.get("lag_s", 0.0)),
                br=BRParams.from_mapping(dict(br)),
                seed=obj.get("seed", 0),
                rolling_s=None if rolling is None else float(rolling),
                clock=obj.get("clock", "configured"),
            )
        except KeyError as err:
            raise ValueError(f"lanes: missing field {err}") from None
        except (TypeError, ValueError) as err:
            raise ValueError(f"lanes: {err}") from None

    def differences(self, other: LaneSettings) -> list[str]:
        """How `other` departs from these settings, one line per setting ("what ran → what now")."""
        out: list[str] = []
        if other.policies != self.policies:
            out.append(f"policies {','.join(other.policies)} (recorded {','.join(self.policies)})")
        if other.step != self.step:
            ran = self.step
            terms = "" if ran.linear else f", c={ran.c:g}, p={ran.p:g}"
            out.append(f"step model {other.step.describe()} (recorded a={ran.a:g}, b={ran.b:g}{terms})")
        if other.slots != self.slots:
            out.append(f"slots {other.slots} (recorded {self.slots})")
        if other.br != self.br:
            mine, theirs = asdict(self.br), asdict(other.br)
            changed = [f"{k}={theirs[k]} (recorded {mine[k]})" for k in mine if mine[k] != theirs[k]]
            out.append("BR parameters " + ", ".join(changed))
        if other.seed != self.seed:
            out.append(f"seed {other.seed} (recorded {self.seed})")
        if other.rolling_s != self.rolling_s:
            def w(x: float | None) -> str:
                return "off" if x is None else f"{x:g} s"
            out.append(f"rolling window {w(other.rolling_s)} (recorded {w(self.rolling_s)})")
        return out


def clock_to_json(clock: LaneClock) -> dict[str, Any]:
    """A lane clock as a recording's `clock` line carries it: its barrier groups and, per worker,
    the step model's terms [a, b, c, p] (what the lanes stepped on and their policies weighed)."""
    out: dict[str, Any] = {"groups": [list(g) for g in clock.groups]}
    if clock.models is not None:
        out["models"] = [[getattr(m, t) for t in TERMS] for m in clock.models]
    return out


def clock_from_json(obj: Mapping[str, Any], workers: int) -> LaneClock:
    """`clock_to_json`'s output for `workers` workers; ValueError (one line) on anything else."""
    groups, models = obj.get("groups"), obj.get("models")
    if not isinstance(groups, list) or not all(
        isinstance(g, list) and all(isinstance(w, int) and not isinstance(w, bool) for w in g) for g in groups
    ):
        raise ValueError("clock: groups must be lists of worker indices")
    parsed: tuple[StepTimeModel, ...] | None = None
    if models is not None:
        if not isinstance(models, list) or not all(
            isinstance(m, list) and len(m) == len(TERMS)
            and all(isinstance(x, int | float) and not isinstance(x, bool) for x in m)
            for m in models
        ):
            raise ValueError("clock: models must be [a, b, c, p] numbers per worker")
        parsed = tuple(StepTimeModel(*map(float, m)) for m in models)
    clock = LaneClock(tuple(tuple(g) for g in groups), parsed)
    clock.check(workers)
    return clock

"""Automated canary analysis of a routing policy: steps of canary fraction, each ended by a verdict
(pure: time and samples are passed in).

A canary runs at `steps[0]` of the request ids, then each next step, then everything (active).
A step ends when it has run `min_step_s` and both cohorts (shadow-routed = the canary, router-routed
= the control, same fleet, same time) have `min_requests` finished requests since it began. It
passes only when, on every judged metric, the canary is shown no worse than the control within that
metric's stated margin; else the canary ends in shadow with the reason:
- TTFT, TPOT: a non-inferiority test, one-sided Mann-Whitney U of H0 "the canary's values exceed
  (1 + margin) × the control's" (the control's scaled by `ttft_margin`, `tpot_margin`), rejected at
  `alpha`: the burden of proof is on the canary, so too few or too noisy samples fail it too;
- error rate: worse only when Fisher's exact test says so at `alpha` AND the rates differ by more
  than `error_margin` (absolute): a non-inferiority bound on a rate near 0 would need about
  3 / margin requests a cohort (the rule of three), and the client_errors fallback trip watches
  the same failures over its own window;
- the fleet's spread (max − min mirrored KV tokens over workers, sampled each check) is reported,
  not judged: Mann-Whitney U on means of batches of `spread_batch` samples (batches, because
  consecutive samples are correlated), the step against the shadow-mode baseline just before the
  canary (its last `baseline_batches` batches). The spread is the fleet's, not a cohort's, so this
  is a before/after comparison, and it is confounded: a control canary of the router's own rule
  (JSQ) raised it 25–63 % in tests/active/test_canary_analysis.py's setup. With
  `spread_blocks=True` it fails a step when worse by the test AND by more than `spread_margin`.
A step that does not get enough requests within `max_step_s` ends the canary too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from shadow.active.cohorts import Outcome, p50
from shadow.base.knobs import AT_LEAST_TWO, NON_NEGATIVE, OPEN_UNIT, POSITIVE_S, check_knobs, knob
from shadow.core.stats import fisher_greater, mann_whitney_greater

METRICS = ("error_rate", "ttft", "tpot", "spread")
VERDICTS = ("pass", "fail", "promoted")


@dataclass(frozen=True)
class CanaryConfig:
    """Steps and the tests' thresholds (`steps` empty: canary at a fixed fraction, no analysis)."""

    steps: tuple[float, ...] = ()
    min_requests: int = knob(
        100, "--canary-min-requests", "finished requests each cohort needs in a step before its verdict",
        AT_LEAST_TWO, metavar="N")
    min_step_s: float = knob(30.0, "--canary-min-step", "shortest step", POSITIVE_S, metavar="SECONDS")
    max_step_s: float = knob(
        900.0, "--canary-max-step", "a step without enough requests by then ends the canary", POSITIVE_S,
        metavar="SECONDS")
    alpha: float = knob(
        0.05, "--canary-alpha", "level of the one-sided tests (non-inferiority Mann-Whitney U for TTFT and "
        "TPOT, Fisher's exact for errors; the fleet's spread is reported, not judged)", OPEN_UNIT,
        metavar="FRACTION")
    error_margin: float = knob(
        0.01, "--canary-error-margin", "error rate the canary may exceed the router's by (absolute)",
        NON_NEGATIVE, metavar="FRACTION")
    ttft_margin: float = knob(
        0.25, "--canary-ttft-margin", "a step passes only when the canary's TTFT is shown below (1 + this) "
        "x the router's (non-inferiority margin)", NON_NEGATIVE, metavar="RATIO")
    tpot_margin: float = knob(
        0.10, "--canary-tpot-margin", "... and its TPOT below (1 + this) x the router's", NON_NEGATIVE,
        metavar="RATIO")
    spread_margin: float = 0.10
    spread_batch: int = 20
    min_batches: int = 4
    baseline_batches: int = 12
    spread_blocks: bool = False

    def validate(self) -> None:
        """ValueError of one line: a setting out of its bound (naming its flag), or steps, batches
        and step times that do not fit together."""
        check_knobs(self)
        s = self.steps
        if any(not (math.isfinite(f) and 0 < f < 1) for f in s) or list(s) != sorted(set(s)):
            raise ValueError(f"canary steps must be increasing fractions in (0, 1), got {list(s)}")
        if self.spread_batch < 1 or not 2 <= self.min_batches <= self.baseline_batches:
            raise ValueError("canary spread batches must be >= 2")
        if not (self.min_step_s <= self.max_step_s and math.isfinite(self.max_step_s)):
            raise ValueError(f"canary step time must satisfy 0 < min {self.min_step_s} <= max "
                             f"{self.max_step_s}")
        if self.spread_margin < 0:
            raise ValueError("the canary's spread margin must be >= 0")


@dataclass
class Verdict:
    """The end of one step: `verdict` pass (next step), promoted (last step passed: active) or fail
    (`reason` says why); `figures` per metric, both cohorts and the test."""

    step: int
    fraction: float
    verdict: str
    reason: str
    at: float
    figures: dict[str, Any] = field(default_factory=dict)

    def line(self) -> str:
        """The verdict as one log line."""
        parts = []
        for m in METRICS:
            f = self.figures.get(m)
            if f is None:
                continue
            p = f.get("p")
            said = f" p={p:.3g}" if p is not None else f" ({f['note']})"
            parts.append(f"{m} {f['canary']}/{f['router']}{said}")
        n = self.figures.get("requests", {})
        return (f"step {self.step + 1} at {self.fraction:.0%}: {self.verdict}"
                + (f" ({self.reason})" if self.reason else "")
                + f"; requests canary/router {n.get('canary', 0)}/{n.get('router', 0)}; " + "; ".join(parts))


def _batch_means(samples: Sequence[float], size: int) -> list[float]:
    return [sum(samples[i:i + size]) / size for i in range(0, len(samples) - size + 1, size)]


def _r(v: float | None, digits: int = 4) -> float | None:
    return None if v is None else round(v, digits)


def _noninferior(name: str, xs: Sequence[float], ys: Sequence[float], margin: float,
                 alpha: float) -> tuple[dict[str, Any], str]:
    """(figures, reason it fails or "") of the non-inferiority test of canary values `xs` against
    control values `ys` (latencies: smaller is better) within `margin` on the ratio."""
    mx, my = p50(xs)[0], p50(ys)[0]
    fig: dict[str, Any] = {"canary": _r(mx), "router": _r(my), "n": [len(xs), len(ys)], "margin": margin,
                           "test": "mann_whitney_u_noninferiority"}
    label = name.upper()
    if len(xs) < 2 or len(ys) < 2 or mx is None or my is None:
        fig.update(p=None, note="too few values")
        return fig, f"{label} not tested: too few values ({len(xs)} canary, {len(ys)} router)"
    fig["ratio"] = _r(mx / my, 3) if my > 0 else None
    _, p = mann_whitney_greater([(1 + margin) * v for v in ys], xs)
    _, fig["p_worse"] = mann_whitney_greater(xs, ys)
    fig["p"] = p
    if p < alpha:
        return fig, ""
    return fig, (f"{label} not shown within {margin:.0%} of the router's: P50 {mx * 1e3:.0f} vs "
                 f"{my * 1e3:.0f} ms (non-inferiority Mann-Whitney p={p:.3g})")


class CanaryAnalysis:
    """See module docstring. `start(now)` returns the first fraction; `evaluate` the step's verdict
    once it is due (None before)."""

    def __init__(self, config: CanaryConfig) -> None:
        config.validate()
        self.config = config
        self.step = -1  # -1: no canary under analysis
        self.step_started = 0.0
        self.started = 0.0
        self.verdicts: list[Verdict] = []
        self.outcome: str | None = None  # promoted | failed, once over

    @property
    def running(self) -> bool:
        return self.step >= 0

    @property
    def fraction(self) -> float:
        return self.config.steps[self.step] if self.running else 0.0

    def start(self, now: float) -> float:
        self.step, self.step_started, self.started, self.outcome = 0, now, now, None
        self.verdicts = []
        return self.fraction

    def stop(self) -> None:
        """The operator left canary: no verdict."""
        self.step = -1

    def abort(self, now: float, reason: str) -> Verdict:
        """The canary ends for a reason outside the analysis (a fallback trip): a fail verdict."""
        return self._verdict(now, "fail", reason, {})

    def evaluate(self, now: float, canary: Sequence[Outcome], router: Sequence[Outcome],
                 spread_step: Sequence[float], spread_base: Sequence[float]) -> Verdict | None:
        """The step's verdict when it is due (samples: since the step began; the spread baseline:
        before the canary), else None. A verdict other than pass ends the analysis."""
        if not self.running:
            return None
        c = self.config
        elapsed = now - self.step_started
        enough = len(canary) >= c.min_requests and len(router) >= c.min_requests
        if elapsed < c.min_step_s or not enough:
            if elapsed < c.max_step_s:
                return None
            reason = (f"not enough requests within {c.max_step_s:g} s (need {c.min_requests} a cohort, got "
                      f"{len(canary)} canary, {len(router)} router)")
            counts = {"requests": {"canary": len(canary), "router": len(router)}}
            return self._verdict(now, "fail", reason, counts)
        figures: dict[str, Any] = {"requests": {"canary": len(canary), "router": len(router)},
                                   "elapsed_s": round(elapsed, 1)}
        worse: list[str] = []
        fc, fr = sum(o.failed for o in canary), sum(o.failed for o in router)
        rc, rr = fc / len(canary), fr / len(router)
        p = fisher_greater(fc, len(canary), fr, len(router))
        figures["error_rate"] = {"canary": _r(rc), "router": _r(rr), "test": "fisher_exact_greater", "p": p}
        if p < c.alpha and rc - rr > c.error_margin:
            worse.append(f"error rate {rc:.1%} vs {rr:.1%} (Fisher p={p:.3g})")
        for name, attr, margin in (("ttft", "ttft_s", c.ttft_margin), ("tpot", "tpot_s", c.tpot_margin)):
            xs = [v for o in canary if not o.failed and (v := getattr(o, attr)) is not None]
            ys = [v for o in router if not o.failed and (v := getattr(o, attr)) is not None]
            fig, why = _noninferior(name, xs, ys, margin, c.alpha)
            figures[name] = fig
            if why:
                worse.append(why)
        recent = list(spread_base)[-c.spread_batch * c.baseline_batches:]
        bs, bb = _batch_means(spread_step, c.spread_batch), _batch_means(recent, c.spread_batch)
        sfig: dict[str, Any] = {"canary": _r(sum(bs) / len(bs) if bs else None, 1),
                                "router": _r(sum(bb) / len(bb) if bb else None, 1),
                                "batches": [len(bs), len(bb)],
                                "test": "mann_whitney_u_greater_on_batch_means",
                                "judged": c.spread_blocks}
        if len(bs) < c.min_batches or len(bb) < c.min_batches:
            sfig.update(p=None, note=f"not tested: fewer than {c.min_batches} batches of {c.spread_batch}")
        else:
            _, p = mann_whitney_greater(bs, bb)
            sfig["p"] = p
            ms, mb = sum(bs) / len(bs), sum(bb) / len(bb)
            if c.spread_blocks and p < c.alpha and ms > (1 + c.spread_margin) * mb:
                worse.append(f"fleet spread {ms:.0f} vs {mb:.0f} tokens (Mann-Whitney p={p:.3g})")
        figures["spread"] = sfig
        if worse:
            return self._verdict(now, "fail", "; ".join(worse), figures)
        last = self.step == len(c.steps) - 1
        return self._verdict(now, "promoted" if last else "pass", "", figures)

    def _verdict(self, now: float, verdict: str, reason: str, figures: dict[str, Any]) -> Verdict:
        v = Verdict(self.step, self.fraction, verdict, reason, now, figures)
        self.verdicts.append(v)
        if verdict == "pass":
            self.step += 1
            self.step_started = now
        else:
            self.outcome = "promoted" if verdict == "promoted" else "failed"
            self.step = -1
        return v

    def report(self) -> dict[str, Any]:
        """The analysis for /v1/report: steps, where it is, every verdict with its figures."""
        return {
            "steps": list(self.config.steps),
            "step": self.step if self.running else None,
            "fraction": self.fraction if self.running else None,
            "outcome": self.outcome,
            "alpha": self.config.alpha,
            "min_requests": self.config.min_requests,
            "margins": {"error_rate": self.config.error_margin, "ttft": self.config.ttft_margin,
                        "tpot": self.config.tpot_margin},
            "verdicts": [{"step": v.step, "fraction": v.fraction, "verdict": v.verdict, "reason": v.reason,
                          "figures": v.figures} for v in self.verdicts],
        }

"""Which step cost an engine pays for: the form of τ = b + c·n + a·L + p·P chosen by out-of-sample
error, each term with its 95 % interval, refitted over a sliding window of measured steps. Pure.

The terms (`TERMS`): `b` fixed per step, `c` per running sequence (n: the requests the step
computed), `a` per KV token held (L), `p` per prefill token scheduled into the step (P). Every
candidate form has `b` and any subset of the other three (`FORMS`, 8 of them).

Samples are window means: W consecutive steps (`window_steps`) give one sample, the mean period
against the mean n, L and P. The model is linear, so window means keep it exactly while averaging
out the per-step jitter a host adds; the windows are kept in time order (the last `max_windows`).

How a form is chosen (`select`):
1. Each form is fitted by least squares on all windows: its terms, their 95 % intervals (OLS
   covariance, t quantile from `shadow.core.intervals.t975` with N − k degrees of freedom) and R².
   A form is *not identified* when one of its columns does not vary over the windows (no prefill
   seen, a constant running count, a constant load) or two of them move together (|r| > 0.99: e.g.
   n and L when every request has the same length); it is *not admissible* when a term's interval
   lies below 0 (a cost cannot be negative: the form explains the steps by something else).
2. Out-of-sample error, time-blocked: the windows are cut into `blocks` contiguous blocks; each is
   predicted by the form fitted on the others (without the one window either side of it, which
   shares its neighbour's state); the error of a window is |predicted − measured| / measured, and a
   form's error is the median over every window (`oos_error`), its block errors the mean in each
   block (a block's mean moves less from block to block than the median of its few windows: more
   power to tell forms apart at the same 95 %).
3. The best form is the admissible one of lowest out-of-sample error. The chosen form is the
   simplest admissible form (fewest terms, then lowest error) that the best one does not beat
   beyond noise: "beyond noise" is a 95 % t-interval of the per-block log ratios of their block
   errors lying wholly above 0. So a term is kept only when every part of the run says it helps.
The model handed on (`CostFit.model`) is the chosen form's fit with any negative estimate (one
within noise of 0, by 1.) at 0.

What is fitted (`CostFit.basis`): where the probe measures the engine's wait for a CPU, the engine's
own work per step, the period less that wait (`shadow.core.hostfactor`): "engine". Its model is the
cost routing balances. The host factor (`CostFit.host`: the period over the engine's work, measured)
says how much the host's wait adds. What the lanes step on (`CostFit.clock_model`) is the model ×
the clock factor (`CostFit.clock_factor`): the periods of the most recent windows over what the model
predicts for them, measured, not fitted; it is the host factor × the engine's work over its model
(on a contended host the engine's own CPU time per step moves with the host too: caches, memory
bandwidth), and it predicts the next window's period better than the host factor alone (measured:
docs/results/vllm-step-cost.md). Without the wait (no schedstat: another platform), the period
itself is fitted, as before: "period", the lanes step on its model. Either way `period_error` says
how well what the lanes step on predicted each window's mean period when it closed (the latest fit's
model × the clock factor of the windows before it): the twin's timeline, one window ahead.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, replace
from itertools import combinations

import numpy as np
import numpy.typing as npt

from shadow.core.hostfactor import (
    HOST_WINDOWS,
    MIN_SPAN,
    HostFactor,
    engine_work,
    host_factor,
    recent_factor,
)
from shadow.core.intervals import t975
from shadow.core.stepmodel import StepTimeModel

#: The terms in column order: fixed, per running sequence, per KV token, per prefill token.
TERMS = ("b", "c", "a", "p")
#: What each term multiplies, as the report writes it.
TERM_FEATURE = {"b": "", "c": "n", "a": "L", "p": "P"}
#: Every candidate form: b with any subset of c, a, p, simplest first.
FORMS: tuple[tuple[str, ...], ...] = tuple(
    ("b", *sub) for k in range(4) for sub in combinations(("c", "a", "p"), k))
WINDOW_STEPS = 25  # steps per sample (window mean)
MAX_WINDOWS = 240  # samples the sliding fit keeps
MIN_WINDOWS = 20  # samples before a form is chosen
BLOCKS = 10  # contiguous blocks of the time-blocked cross-validation
REFIT_EVERY = 4  # windows between two form fits (the form stands until then)
CLAMP = 4.0  # a step beyond this multiple of the chosen model's prediction is left out (a host stall)
TINY_ERROR = 1e-9  # a block error below this is this (an exact fit: its log is finite)
COLLINEAR = 0.99  # |correlation| beyond which two columns are confounded
OOS_ERROR_MAX = 0.10  # out-of-sample median absolute relative error the figures need
PERIOD_ERROR_MAX = 0.10  # median error of the clock's window periods, one window ahead, the figures need
ENGINE_SHARE = 0.75  # of the windows, those with the engine's work known for the fit to be on it
BASES = ("engine", "period")  # what a cost fit is of: the engine's work per step, or its period


def form_key(form: tuple[str, ...]) -> str:
    """"b+c+a" for ("b", "c", "a"): the form as a metric label."""
    return "+".join(form)


def form_label(form: tuple[str, ...]) -> str:
    """"b + c·n + a·L" for ("b", "c", "a")."""
    return " + ".join(t if t == "b" else f"{t}·{TERM_FEATURE[t]}" for t in form)


@dataclass(frozen=True, slots=True)
class Term:
    """One fitted term with its 95 % interval (seconds per unit of its feature)."""

    value: float
    low: float
    high: float


@dataclass(frozen=True, slots=True)
class FormFit:
    """One candidate form over the windows: its terms (empty when not identified), R² and
    out-of-sample error (median over the windows; None when not identified), its block errors (mean
    per block), and why it is out (None: admissible)."""

    form: tuple[str, ...]
    terms: dict[str, Term]
    r2: float | None
    oos_error: float | None
    block_errors: tuple[float, ...]
    residual_s: float | None  # residual standard error of the window means
    why_not: str | None = None

    @property
    def label(self) -> str:
        return form_label(self.form)

    @property
    def admissible(self) -> bool:
        return self.why_not is None


@dataclass(frozen=True, slots=True)
class CostFit:
    """The step-cost model chosen over `windows` window means of `window_steps` steps each (`steps`
    in all, `outliers` left out): `chosen` (None: too few windows or no admissible form, `reason`
    says which), every candidate (`forms`), the terms the data cannot identify and why
    (`not_identified`), and the spread of the window means fitted (`mean_s`, `window_cv`). What was
    fitted: `basis` ("engine": the engine's work per step; "period": the step period, `basis_reason`
    says why), the host factor over the windows (`host`, None without the engine's wait), and how
    well the clock predicted the window periods one window ahead (`period_error`, median over
    `period_windows`)."""

    chosen: FormFit | None
    forms: tuple[FormFit, ...]
    windows: int
    window_steps: int
    steps: int
    outliers: int
    not_identified: dict[str, str]
    reason: str
    mean_s: float | None = None
    window_cv: float | None = None
    best: str | None = None  # the label of the lowest-error admissible form
    basis: str = "period"
    basis_reason: str = ""
    host: HostFactor | None = None
    clock_factor: float | None = None  # engine basis: the recent periods over the model's prediction
    period_error: float | None = None
    period_windows: int = 0

    @property
    def model(self) -> StepTimeModel | None:
        """The chosen form as a step model (negative estimates at 0): the engine's cost on the engine
        basis, the period's on the period basis; None without one."""
        if self.chosen is None:
            return None
        v = {t: max(0.0, self.chosen.terms[t].value) if t in self.chosen.terms else 0.0 for t in TERMS}
        if not any(v.values()):
            return None
        return StepTimeModel(a=v["a"], b=v["b"], c=v["c"], p=v["p"])

    @property
    def clock_model(self) -> StepTimeModel | None:
        """What a lane steps on: the model × the clock factor on the engine basis (every term scaled:
        κ = c/a is the engine's), the model itself on the period basis."""
        return scaled(self.model, self.clock_factor if self.basis == "engine" else None)

    @property
    def host_wait_share(self) -> float | None:
        """The engine's wait for a CPU over its period, over the windows where it is known."""
        return None if self.host is None else self.host.wait_share

    @property
    def residual_cv(self) -> float | None:
        """The chosen form's residual standard error over the mean window: what the terms leave
        unexplained (the host, or what no term measures), as a fraction of the step."""
        if self.chosen is None or self.chosen.residual_s is None or not self.mean_s:
            return None
        return self.chosen.residual_s / self.mean_s

    @property
    def driver(self) -> str | None:
        """"load" when the terms explain most of the windows' variance (R² ≥ 0.5), "host" when the
        residual (host contention, or what no term measures) is the larger part; None without a fit."""
        if self.chosen is None or self.chosen.r2 is None:
            return None
        return "load" if self.chosen.r2 >= 0.5 else "host"


def scaled(model: StepTimeModel | None, factor: float | None) -> StepTimeModel | None:
    """`model` with every term × `factor` (None: as it is)."""
    if model is None or factor is None or factor == 1.0:
        return model
    return StepTimeModel(a=model.a * factor, b=model.b * factor, c=model.c * factor, p=model.p * factor)


@dataclass(frozen=True, slots=True)
class _Ols:
    coef: npt.NDArray[np.float64]
    se: npt.NDArray[np.float64]
    dof: int
    rss: float


class _Gram:
    """Least squares from sums: the scaled design's ZᵀZ, Zᵀy and yᵀy over a set of windows, so a
    form (a subset of the columns) and a training set (all windows minus some) cost a 4×4 solve."""

    def __init__(self, z: npt.NDArray[np.float64], y: npt.NDArray[np.float64]) -> None:
        self.zz = z.T @ z
        self.zy = z.T @ y
        self.yy = float(y @ y)
        self.n = len(y)

    def minus(self, other: _Gram) -> _Gram:
        out = object.__new__(_Gram)
        out.zz, out.zy = self.zz - other.zz, self.zy - other.zy
        out.yy, out.n = self.yy - other.yy, self.n - other.n
        return out

    def solve(self, cols: list[int]) -> _Ols | None:
        """None when rank deficient or without a residual degree of freedom."""
        k = len(cols)
        if self.n <= k:
            return None
        g = self.zz[np.ix_(cols, cols)]
        eig = np.linalg.eigvalsh(g)
        if not eig[0] > 1e-10 * max(eig[-1], 1e-300):
            return None
        inv = np.linalg.inv(g)
        coef = inv @ self.zy[cols]
        rss = max(0.0, self.yy - 2.0 * float(coef @ self.zy[cols]) + float(coef @ g @ coef))
        dof = self.n - k
        se = np.sqrt(np.clip(np.diag(inv) * (rss / dof), 0.0, None))
        return _Ols(coef, se, dof, rss)


def _blocks(n: int, blocks: int) -> list[tuple[int, int]]:
    edges = [round(i * n / blocks) for i in range(blocks + 1)]
    return [(edges[i], edges[i + 1]) for i in range(blocks) if edges[i + 1] > edges[i]]


def _identification(cols: dict[str, npt.NDArray[np.float64]]) -> dict[str, str]:
    """The terms the windows cannot identify, with the reason."""
    out: dict[str, str] = {}
    what = {"c": "the running count", "a": "the KV load", "p": "the prefill tokens"}
    for t in ("c", "a", "p"):
        x = cols[t]
        sd = float(x.std())
        if not sd > 1e-3 * max(1e-9, float(np.abs(x).mean())):
            level = float(x.mean())
            seen = "none seen" if level == 0 else f"{level:g} throughout"
            out[t] = (f"{what[t]} did not vary over the windows ({seen}): its cost cannot be told from the "
                      "fixed cost")
    varying = [t for t in ("c", "a", "p") if t not in out]
    for s, t in combinations(varying, 2):
        r = float(np.corrcoef(cols[s], cols[t])[0, 1])
        if abs(r) > COLLINEAR:
            out[f"{s}+{t}"] = f"{what[s]} and {what[t]} moved together (r = {r:.3f}): confounded"
    return out


@dataclass(frozen=True, slots=True)
class _Design:
    """The scaled design of all windows, its sums, and per block the sums of what its training set
    leaves out (the block and the window either side)."""

    z: npt.NDArray[np.float64]
    y: npt.NDArray[np.float64]
    scale: npt.NDArray[np.float64]
    full: _Gram
    train: list[_Gram]
    parts: list[tuple[int, int]]

    @classmethod
    def of(cls, cols: dict[str, npt.NDArray[np.float64]], y: npt.NDArray[np.float64], blocks: int) -> _Design:
        x = np.column_stack([cols[t] for t in TERMS])
        scale = np.abs(x).max(axis=0)
        scale[scale == 0] = 1.0
        z = x / scale
        full = _Gram(z, y)
        parts = _blocks(len(y), blocks)
        n = len(y)
        train = [full.minus(_Gram(z[max(0, lo - 1):min(n, hi + 1)], y[max(0, lo - 1):min(n, hi + 1)]))
                 for lo, hi in parts]
        return cls(z, y, scale, full, train, parts)


def _fit_form(form: tuple[str, ...], d: _Design, unidentified: dict[str, str]) -> FormFit:
    bad = [why for key, why in unidentified.items() if set(key.split("+")) <= set(form)]
    if bad:
        return FormFit(form, {}, None, None, (), None, "not identified: " + "; ".join(bad))
    cols = [TERMS.index(t) for t in form]
    full = d.full.solve(cols)
    if full is None:
        return FormFit(form, {}, None, None, (), None, "not identified: too few windows for its terms")
    tq = t975(full.dof)
    scale = d.scale[cols]
    terms = {t: Term(float(v / sc), float((v - tq * se) / sc), float((v + tq * se) / sc))
             for t, v, se, sc in zip(form, full.coef, full.se, scale, strict=True)}
    y = d.y
    tss = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - full.rss / tss if tss > 0 else (1.0 if full.rss == 0 else 0.0)
    errors = np.full(len(y), np.inf)
    for (lo, hi), train in zip(d.parts, d.train, strict=True):
        fit = train.solve(cols)
        if fit is not None:
            errors[lo:hi] = np.abs(d.z[lo:hi][:, cols] @ fit.coef - y[lo:hi]) / y[lo:hi]
    block = tuple(float(np.mean(errors[lo:hi])) for lo, hi in d.parts)
    negative = [t for t, term in terms.items() if term.high < 0]
    why = None if not negative else "significantly negative " + ", ".join(negative)
    return FormFit(form, terms, max(0.0, min(1.0, r2)), float(np.median(errors)), block,
                   math.sqrt(full.rss / full.dof), why)


def _beats(better: FormFit, other: FormFit) -> bool:
    """True when `better`'s block errors are below `other`'s beyond noise: the 95 % t-interval of
    the per-block log ratios of their errors (other over better) wholly above 0. On the log scale a
    form that is k times better in every block is k times better whatever each block's scale: a
    block whose windows happen to sit near the mean (every form's error small there) does not
    outweigh the others, as it would in differences of errors."""
    o, b = np.asarray(other.block_errors), np.asarray(better.block_errors)
    if len(o) < 2 or not (np.all(np.isfinite(o)) and np.all(np.isfinite(b))):
        return bool(np.all(np.isfinite(b))) and not np.all(np.isfinite(o))
    d = np.log(np.maximum(o, TINY_ERROR)) - np.log(np.maximum(b, TINY_ERROR))
    m = float(d.mean())
    half = t975(len(d) - 1) * float(d.std(ddof=1)) / math.sqrt(len(d))
    return m - half > 0


def select(
    cost_s: npt.ArrayLike, seqs: npt.ArrayLike, kv_tokens: npt.ArrayLike, prefill_tokens: npt.ArrayLike,
    *, window_steps: int = 1, steps: int | None = None, outliers: int = 0, blocks: int = BLOCKS,
    min_windows: int = MIN_WINDOWS,
) -> CostFit:
    """Choose the form over window means given in time order (see module docstring): the mean cost
    per step to fit (s, > 0: the engine's work, or the period), running sequences, KV tokens and
    prefill tokens of each window. The result's basis is "period" (the caller says otherwise)."""
    y = np.asarray(cost_s, dtype=np.float64)
    cols = {"b": np.ones(len(y)), "c": np.asarray(seqs, dtype=np.float64),
            "a": np.asarray(kv_tokens, dtype=np.float64), "p": np.asarray(prefill_tokens, dtype=np.float64)}
    n = len(y)
    steps = n * window_steps if steps is None else steps
    if n < max(min_windows, 2 * blocks, 3):
        return CostFit(None, (), n, window_steps, steps, outliers, {},
                       f"{n} windows of {window_steps} steps (needs {max(min_windows, 2 * blocks, 3)})")
    mean = float(y.mean())
    cv = float(y.std(ddof=1)) / mean if mean > 0 else None
    unidentified = _identification(cols)
    design = _Design.of(cols, y, blocks)
    fits = tuple(_fit_form(f, design, unidentified) for f in FORMS)
    ok = [f for f in fits if f.admissible]
    if not ok:
        return CostFit(None, fits, n, window_steps, steps, outliers, unidentified,
                       "no form without a significantly negative term", mean, cv)
    best = min(ok, key=lambda f: (f.oos_error if f.oos_error is not None else math.inf, len(f.form)))
    for f in sorted(ok, key=lambda f: (len(f.form), f.oos_error if f.oos_error is not None else math.inf)):
        if f is best or not _beats(best, f):
            why = ("the lowest out-of-sample error" if f is best else
                   f"the form of lowest error, {best.label}, is not better beyond noise")
            return CostFit(f, fits, n, window_steps, steps, outliers, unidentified, why, mean, cv, best.label)
    raise AssertionError("unreachable: the best form is always chosen last")  # pragma: no cover


@dataclass
class _Window:
    steps: int = 0
    sums: list[float] = field(default_factory=lambda: [0.0] * 4)  # period, n, L, P
    # per member (a worker of the group): Σ wait, Σ span with the wait known, Σ period of its steps
    host: dict[int, list[float]] = field(default_factory=dict)


class StepCostFit:
    """The sliding fit: `add` one measured step at a time (its period, running sequences, KV tokens,
    prefill tokens, and where the probe measures it the engine's wait for a CPU over a span of its
    time ending at the step); every `window_steps` of them make a window mean (the period, the
    features, the engine's work: `shadow.core.hostfactor.engine_work`); the last `max_windows` are
    kept (bounded memory) and the form is chosen over them as a window closes (every `refit_every`
    windows, and at every window until the first fit stands) on the engine's work when it is known
    in `ENGINE_SHARE` of the windows and at least as many as a fit needs, else on the period; the
    host factor and the period check follow every window; `result()` gives the latest of each.
    Once a form is chosen, a step without prefill longer than `clamp` × what the clock model
    predicts for it is left out and counted (a host stall is no cost of the load; a step holding a
    prefill is always kept: its cost may be what the chosen form does not have yet); non-finite or
    negative input is ignored."""

    def __init__(self, window_steps: int = WINDOW_STEPS, max_windows: int = MAX_WINDOWS, *,
                 min_windows: int = MIN_WINDOWS, blocks: int = BLOCKS, clamp: float = CLAMP,
                 refit_every: int = REFIT_EVERY, host_windows: int = HOST_WINDOWS) -> None:
        if window_steps < 1 or max_windows < max(min_windows, 2 * blocks) or blocks < 2 or not clamp > 1 \
                or refit_every < 1 or host_windows < 1:
            raise ValueError("step cost fit: window_steps >= 1, blocks >= 2, max_windows >= "
                             "max(min_windows, 2 blocks), clamp > 1, refit_every >= 1, host_windows >= 1")
        self.refit_every = refit_every
        self.host_windows = host_windows
        self._new = 0  # windows closed since the latest form fit
        self.window_steps = window_steps
        self.min_windows = min_windows
        self.blocks = blocks
        self.clamp = clamp
        # window means of (period, n, L, P, engine work: NaN when its wait is not known)
        self.windows: deque[tuple[float, float, float, float, float]] = deque(maxlen=max_windows)
        # |clock's prediction − period| / period of each window closed once a model stood
        self.period_errors: deque[float] = deque(maxlen=max_windows)
        self._open = _Window()
        self.taken = 0  # steps taken since the start (kept or not: the windows slide)
        self.outliers = 0
        self._fit: CostFit | None = None  # the latest form fit
        self._ref: StepTimeModel | None = None  # what the lanes step on now (the clamp's, the check's)
        self._result: CostFit | None = None  # the latest result (None: a window closed since)

    def add(self, period_s: float, seqs: float, kv_tokens: float, prefill_tokens: float,
            host_wait_s: float | None = None, span_s: float | None = None, member: int = 0) -> bool:
        """One step; `host_wait_s`: the seconds the engine (of group member `member`) waited for a
        CPU over the `span_s` seconds of its time ending at this step (default: the period). False
        when it was left out (invalid, or a stall beyond the clamp)."""
        values = (period_s, seqs, kv_tokens, prefill_tokens)
        if not (all(math.isfinite(v) and v >= 0 for v in values) and period_s > 0):
            return False
        ref = self._ref
        if ref is not None and not prefill_tokens and period_s > self.clamp * ref.worker_time(
                kv_tokens, seqs):
            self.outliers += 1
            return False
        self.taken += 1
        w = self._open
        w.steps += 1
        w.sums = [s + v for s, v in zip(w.sums, values, strict=True)]
        span = period_s if span_s is None else span_s
        if host_wait_s is not None and all(math.isfinite(x) and x >= 0 for x in (host_wait_s, span)):
            acc = w.host.setdefault(member, [0.0, 0.0, 0.0])
            acc[0] += host_wait_s
            acc[1] += span
        w.host.setdefault(member, [0.0, 0.0, 0.0])[2] += period_s
        if w.steps == self.window_steps:
            self._close(w)
        return True

    def _close(self, w: _Window) -> None:
        k = float(w.steps)
        period, n, kv, prefill = (x / k for x in w.sums)
        work = engine_work(period, [(a, s, MIN_SPAN * q) for a, s, q in w.host.values()])
        self._check(period, n, kv, prefill)
        self.windows.append((period, n, kv, prefill, work))
        self._open = _Window()
        self._new += 1
        self._result = None
        if self._new >= self.refit_every or len(self.windows) < self.min_windows + self.refit_every:
            self._refit()
        self._ref = self._clock()

    def _refit(self) -> None:
        """The form fit over the windows now (at a window's close when due: what the clamp and the
        period check refer to from then on, whoever asks for results and how often)."""
        self._fit = self._form(np.asarray(self.windows, dtype=np.float64).reshape(-1, 5))
        self._new = 0

    def _factor(self) -> float | None:
        """The clock factor now (engine basis): Σ period / Σ the latest model's prediction over the
        last `host_windows` windows; None without a model or on the period basis."""
        fit = self._fit
        model = fit.model if fit is not None else None
        if fit is None or model is None or fit.basis != "engine":
            return None
        last = list(self.windows)[-self.host_windows:]
        return recent_factor((p, model.worker_time(kv, n, prefill)) for p, n, kv, prefill, _ in last)

    def _clock(self) -> StepTimeModel | None:
        """What the lanes step on now: the latest model × the clock factor on the engine basis (None
        without both), the model on the period basis."""
        fit = self._fit
        if fit is None or fit.model is None:
            return None
        if fit.basis != "engine":
            return fit.model
        factor = self._factor()
        return None if factor is None else scaled(fit.model, factor)

    def _check(self, period: float, n: float, kv: float, prefill: float) -> None:
        """How far the clock was off a window closing now: the latest fit's model × (engine basis)
        the clock factor of the windows before it."""
        clock = self._ref
        if clock is not None:
            self.period_errors.append(abs(clock.worker_time(kv, n, prefill) - period) / period)

    def result(self) -> CostFit:
        if self._result is not None:
            return self._result
        if self._fit is None:
            self._refit()
        assert self._fit is not None
        data = np.asarray(self.windows, dtype=np.float64).reshape(-1, 5)
        errors = list(self.period_errors)
        self._result = replace(self._fit, host=host_factor(data[:, 0], data[:, 4], self.host_windows),
                               clock_factor=self._factor(),
                               period_error=float(np.median(errors)) if errors else None,
                               period_windows=len(errors))
        return self._result

    def _form(self, data: npt.NDArray[np.float64]) -> CostFit:
        """The form fit over the windows, on the engine's work when it is known in enough of them."""
        known = np.isfinite(data[:, 4]) & (data[:, 4] > 0)
        need = max(self.min_windows, 2 * self.blocks)
        steps = len(data) * self.window_steps
        if known.sum() >= max(need, ENGINE_SHARE * len(data)):
            d = data[known]
            fit = select(d[:, 4], d[:, 1], d[:, 2], d[:, 3], window_steps=self.window_steps, steps=steps,
                         outliers=self.outliers, blocks=self.blocks, min_windows=self.min_windows)
            return replace(fit, basis="engine", basis_reason=(
                "the engine's work per step (the period less its wait for a CPU, measured) in "
                f"{int(known.sum())} of {len(data)} windows"))
        fit = select(data[:, 0], data[:, 1], data[:, 2], data[:, 3], window_steps=self.window_steps,
                     steps=steps, outliers=self.outliers, blocks=self.blocks, min_windows=self.min_windows)
        why = ("the step period: the engine's wait for a CPU is not measured (the probe sends no schedstat: "
               "another platform, or no /proc)" if not known.any() else
               f"the step period: the engine's wait for a CPU is known in only {int(known.sum())} of "
               f"{len(data)} windows (needs {ENGINE_SHARE:.0%} and {need})")
        return replace(fit, basis="period", basis_reason=why)

"""How far the twin (the `actual` lane: the router's real placements replayed) is from reality, per
worker, as time averages over windows of `window_s` of event time (an absolute grid), three ways:

- `placed`: every request placed on a worker and not ended (KV tokens: prompt + generated; the
  lane's `placed_loads`, with requests whose streams have not ended yet) against the mirror's, from
  the requests' events — what the router and the taps see;
- `running` and `kv`: the lane's running requests and the KV its engine holds against the engine's
  own, from its probe's steps (running after each step; KV usage × the KV the usage is of, in the
  events' tokens: `ServerTimes.kv_tokens`) — what the engine does, which the HTTP side's delays do
  not blur.

Each side is a step function of time (its value holds until the next one), integrated into the
windows exactly; a window counts once every side is past its end. Error = Σ over the windows and
workers of |twin − reality| / Σ of reality (0: the same time averages). Pure: times come in.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any


class _Series:
    """A vector-valued step function of time, integrated per window (Σ value·dt per window index)."""

    __slots__ = ("n", "sums", "t", "v", "window_s")

    def __init__(self, n: int, window_s: float) -> None:
        self.n = n
        self.window_s = window_s
        self.t: float | None = None
        self.v: list[float] = [0.0] * n
        self.sums: dict[int, list[float]] = {}

    def set(self, t: float, v: Sequence[float]) -> None:
        """The value is `v` from t on (a t before the last one counts as the last one)."""
        self.advance(t)
        if self.t is None:
            self.t = t
        self.v = list(v)

    def advance(self, t: float) -> None:
        """The value held up to t."""
        t0 = self.t
        if t0 is None or not t > t0:
            return
        w = self.window_s
        i = math.floor(t0 / w)
        while t0 < t:
            end = min(t, (i + 1) * w)
            acc = self.sums.get(i)
            if acc is None:
                acc = self.sums[i] = [0.0] * self.n
            dt = end - t0
            for j, x in enumerate(self.v):
                acc[j] += x * dt
            t0 = end
            i += 1
        self.t = t

    def past(self) -> int:
        """Windows below this index are complete (the series is past their end)."""
        return -(2**62) if self.t is None else math.floor(self.t / self.window_s)

    def take(self, i: int) -> list[float]:
        """Window i's mean value (its integral over the window), forgotten here."""
        acc = self.sums.pop(i, None)
        return [0.0] * self.n if acc is None else [x / self.window_s for x in acc]


class TwinCheck:
    """See module docstring. `mirror`, `engine`, `lane` give each side's values as they change;
    `settle(now)` closes the windows every side is past (an engine without steps since holds its last
    state: it is idle); `figures()` is the report's block."""

    def __init__(self, workers: int, window_s: float, kv_tokens: Callable[[int], float | None],
                 recent: int = 30, names: Sequence[str] | None = None) -> None:
        if not window_s > 0:
            raise ValueError(f"twin check window must be > 0 s, got {window_s}")
        self.workers = workers
        self.names = list(names) if names is not None else [str(g) for g in range(workers)]
        self.window_s = window_s
        self.kv_tokens = kv_tokens
        self._mirror = _Series(workers, window_s)
        self._lane = [_Series(3, window_s) for _ in range(workers)]  # placed, running, KV tokens
        self._engine = [_Series(2, window_s) for _ in range(workers)]  # running, KV usage
        self._engine_seen = False
        self._next: int | None = None  # the next window to close
        self.windows = 0
        self.engine_windows = 0
        # Σ |twin − reality|, Σ reality and Σ twin over closed windows, per comparison
        self.sums: dict[str, list[float]] = {k: [0.0, 0.0, 0.0] for k in ("placed", "running", "kv")}
        # ... per worker: Σ |twin − reality| and Σ reality
        self.per_worker: dict[str, list[list[float]]] = {k: [[0.0, 0.0] for _ in range(workers)]
                                                         for k in self.sums}
        self.recent: dict[str, deque[float]] = {k: deque(maxlen=recent) for k in self.sums}

    def mirror(self, t: float, placed: Sequence[float]) -> None:
        self._mirror.set(t, placed)
        self._start(t)

    def engine(self, g: int, t: float, running: int, kv_usage: float) -> None:
        self._engine_seen = True
        self._engine[g].set(t, (running, kv_usage))

    def lane(self, g: int, t: float, placed: float, running: int, kv: float) -> None:
        """Worker g of the twin from t on (its state after a step that ended at t)."""
        self._lane[g].set(t, (placed, running, kv))
        self._start(t)

    def lane_placed(self, g: int, t: float, delta: float) -> None:
        """A request placed on worker g at t (its prompt: `delta`), before its next step."""
        series = self._lane[g]
        v = list(series.v)
        v[0] += delta
        series.set(t, v)
        self._start(t)

    def lane_clock(self, t: float) -> None:
        """The twin is past t: a worker without a step since holds its state up to t."""
        for series in self._lane:
            if series.t is not None:
                series.advance(t)

    def _start(self, t: float) -> None:
        if self._next is None:
            self._next = math.floor(t / self.window_s) + 1  # the first whole window

    def settle(self, now: float, slack_s: float = 3.0) -> None:
        """Close the windows every side is past; engines are taken as idle (holding their last
        state) up to `now − slack_s` (their steps come in batches, behind the requests' events)."""
        if self._next is None:
            return
        upto = min(self._mirror.past(), *(s.past() for s in self._lane))
        if self._engine_seen:
            for e in self._engine:
                if e.t is None:  # no step yet: idle (zero) so far
                    e.t = now - slack_s
                e.advance(now - slack_s)
            upto = min(upto, *(e.past() for e in self._engine))
        while self._next < upto:
            self._close(self._next)
            self._next += 1

    def _close(self, i: int) -> None:
        m = self._mirror.take(i)
        lane = [s.take(i) for s in self._lane]
        n = self.workers
        self.windows += 1
        self._add("placed", [x[0] for x in lane], m)
        if not self._engine_seen:
            return
        eng = [e.take(i) for e in self._engine]
        self.engine_windows += 1
        self._add("running", [x[1] for x in lane], [x[0] for x in eng])
        caps = [self.kv_tokens(g) for g in range(n)]
        if all(c is not None for c in caps):
            self._add("kv", [x[2] for x in lane], [x[1] * (c or 0.0) for x, c in zip(eng, caps, strict=True)])

    def _add(self, what: str, twin: Sequence[float], real: Sequence[float]) -> None:
        total = sum(real)
        if total <= 0:
            return
        diff = sum(abs(a - b) for a, b in zip(twin, real, strict=True))
        acc = self.sums[what]
        acc[0] += diff
        acc[1] += total
        acc[2] += sum(twin)
        for g, (a, b) in enumerate(zip(twin, real, strict=True)):
            w = self.per_worker[what][g]
            w[0] += abs(a - b)
            w[1] += b
        self.recent[what].append(diff / total)

    def error(self, what: str) -> float | None:
        """Σ|twin − reality| / Σ reality over the closed windows (None before any)."""
        diff, total, _ = self.sums[what]
        return diff / total if total > 0 else None

    def ratio(self, what: str) -> float | None:
        """Σ twin / Σ reality over the closed windows: the bias in the error (1: none)."""
        _, total, twin = self.sums[what]
        return twin / total if total > 0 else None

    def figures(self) -> dict[str, Any]:
        recent = {k: (sum(v) / len(v) if v else None) for k, v in self.recent.items()}
        return {
            "window_s": self.window_s,
            "windows": self.windows,
            "engine_windows": self.engine_windows,
            "placed_vs_mirror": self.error("placed"),
            "running_vs_engine": self.error("running"),
            "kv_vs_engine": self.error("kv"),
            "ratio": {k: self.ratio(k) for k in self.sums},
            "recent": recent,
            "workers": {name: {k: _ratio(v[g][0], v[g][1]) for k, v in self.per_worker.items()}
                        for g, name in enumerate(self.names)},
        }


def _ratio(x: float, y: float) -> float | None:
    return x / y if y > 0 else None

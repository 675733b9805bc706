"""Compact session recordings (`--record FILE`): what a replay needs, not one line per token.

NDJSON, gzip when the path ends in `.gz`, rotated by size (`FILE` → `FILE.1`, `FILE.2`, …; every
part starts with the header, so each part replays on its own):
- `{"type": "session", "version": 2, "workers": [...], "slots": B|null, "lanes": {...}}` — the
  configured decode workers (a worker that got no traffic is still a worker) and, from `shadow
  serve`, what its live lanes ran with (policies, step model and its source, lag, BR parameters,
  seed), so that a replay reproduces them without flags (version 1 headers have no `lanes`);
- `{"type": "request", "request_id", "arrival_t", "prompt_tokens", "output_tokens", "worker",
  "prompt_key", "body_bytes", "end", "t_end"}` (body_bytes: the request body's size, where the
  taps saw it) — one line when a request ends (folded from its events by
  `shadow.engine.feed.RequestFolder`, exactly as an event-by-event recording is replayed);
- `{"type": "steps", "worker", "t", "n", "sum_s", "min_s", "max_s"}` — measured decode steps
  aggregated per worker every `step_every_s` seconds;
- `{"type": "seed", "window", "t", "origin", "window_s", "requests"}` — with rolling lanes, the
  mirrored fleet each window started from (`shadow.engine.rolling.Seed`), given by the lanes'
  thread through `seed()` (thread-safe), written at the next flush;
- `{"type": "clock", "t", "groups", "models"}` — with the measured lane clock, the barrier groups
  and per-worker step models [a, b, c, p] the live lanes stepped on and their policies weighed
  (`shadow.engine.settings.clock_to_json`), each time they change (`clock()`, thread-safe), so
  that a replay runs on the cost model the lanes last used.
`shadow replay FILE` reads it (and the older one-event-per-line recordings) within
`shadow.traces.TraceLimits`: token counts up to the live mirror's bound (the events written here
passed it), and lines, workers, workers × slots, lanes and rolling windows up to their limits.
Memory: requests in flight (bounded by `max_open`, oldest dropped and counted) and a bounded write
buffer.
"""

from __future__ import annotations

import gzip
import json
import os
from collections import deque
from collections.abc import Mapping, Sequence
from typing import IO, Any

from shadow.contracts.events import Event, Step
from shadow.engine.config import LaneClock
from shadow.engine.feed import Recorded, RequestFolder
from shadow.engine.rolling import Seed
from shadow.engine.settings import clock_to_json

VERSION = 2


def request_line(r: Recorded, end: str | None = None, t_end: float | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "type": "request",
        "request_id": r.request_id,
        "arrival_t": r.arrival_s,
        "prompt_tokens": r.prompt_tokens,
        "output_tokens": r.output_tokens,
        "worker": r.worker,
    }
    if r.prompt_key is not None:
        out["prompt_key"] = r.prompt_key
    if r.body_bytes is not None:
        out["body_bytes"] = r.body_bytes
    if end is not None:
        out["end"] = end
    if t_end is not None:
        out["t_end"] = t_end
    return out


class CompactRecorder:
    """See module docstring. Same interface as `hub.Recorder` (write / flush / close, counters)."""

    def __init__(
        self,
        path: str,
        *,
        workers: Sequence[str] = (),
        slots: int | None = None,
        lanes: Mapping[str, Any] | None = None,
        max_bytes: int | None = None,
        step_every_s: float = 10.0,
        max_buffered: int = 100_000,
        max_open: int = 1_000_000,
    ) -> None:
        if max_bytes is not None and max_bytes < 4096:
            raise ValueError(f"record rotation size must be >= 4096 bytes, got {max_bytes}")
        self.path = path
        self.gzip = path.endswith(".gz")
        self.max_bytes = max_bytes
        self.step_every_s = step_every_s
        self.max_buffered = max_buffered
        self.header: dict[str, Any] = {"type": "session", "version": VERSION, "workers": list(workers),
                                       "slots": slots}
        if lanes is not None:
            self.header["lanes"] = dict(lanes)
        self.folder = RequestFolder(max_open=max_open)
        self._steps: dict[str | None, list[float]] = {}  # worker -> [t0, n, sum, min, max]
        self._lines: list[str] = []
        # seeds and clocks, from other threads (deque appends are atomic), in the order given
        self._seeds: deque[Seed | dict[str, Any]] = deque()
        self._fh: IO[str] | None = None
        self._bytes = 0
        self.parts = 0
        self.written = 0
        self.dropped = 0
        self.errors = 0
        self._open()

    def _open(self) -> None:
        exists = os.path.exists(self.path) and os.path.getsize(self.path) > 0
        if self.gzip:
            self._fh = gzip.open(self.path, "at", encoding="utf-8")  # noqa: SIM115 - closed in close()
        else:
            self._fh = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._bytes = os.path.getsize(self.path) if exists else 0
        if not exists:
            self._write_lines([json.dumps(self.header, separators=(",", ":"))])

    def _rotate(self) -> None:
        assert self._fh is not None
        self._fh.close()
        self.parts += 1
        base, ext = (self.path[:-3], ".gz") if self.gzip else (self.path, "")
        os.replace(self.path, f"{base}.{self.parts}{ext}")
        self._open()

    def write(self, ev: Event) -> None:
        if isinstance(ev, Step):
            self._step(ev)
            return
        done = self.folder.apply(ev)
        if done is None:
            return
        rec, reason, t_end = done
        if rec is None:
            return  # dropped by the folder's rules (counted there)
        self._add(request_line(rec, reason, t_end))

    def seed(self, seed: Seed) -> None:
        """A rolling window's seed, from any thread; written with the next flush."""
        self._seeds.append(seed)

    def clock(self, t: float, clock: LaneClock) -> None:
        """The lanes' clock from time `t` on (their step models), from any thread; written with
        the next flush."""
        self._seeds.append({"type": "clock", "t": t, **clock_to_json(clock)})

    def _add(self, obj: dict[str, Any]) -> None:
        if len(self._lines) >= self.max_buffered:
            self.dropped += 1
            return
        self._lines.append(json.dumps(obj, separators=(",", ":")))

    def _step(self, ev: Step) -> None:
        agg = self._steps.get(ev.worker)
        d = ev.duration_s
        if agg is None:
            self._steps[ev.worker] = [ev.t, 1, d, d, d]
            return
        agg[1] += 1
        agg[2] += d
        agg[3] = min(agg[3], d)
        agg[4] = max(agg[4], d)
        if ev.t - agg[0] >= self.step_every_s:
            self._flush_steps(ev.worker, ev.t)

    def _flush_steps(self, worker: str | None, t: float) -> None:
        agg = self._steps.pop(worker)
        self._add(
            {
                "type": "steps",
                "worker": worker,
                "t": t,
                "n": int(agg[1]),
                "sum_s": agg[2],
                "min_s": agg[3],
                "max_s": agg[4],
            }
        )

    def _write_lines(self, lines: list[str]) -> None:
        assert self._fh is not None
        text = "\n".join(lines) + "\n"
        self._fh.write(text)
        self._fh.flush()
        self._bytes += len(text.encode("utf-8")) if not self.gzip else len(text) // 4  # gzip: rough
        self.written += len(lines)

    def flush(self) -> None:
        while self._seeds:
            item = self._seeds.popleft()
            self._add(item if isinstance(item, dict) else item.to_json())
        if not self._lines or self._fh is None:
            return
        lines, self._lines = self._lines, []
        try:
            if self.max_bytes is not None and self._bytes >= self.max_bytes:
                self._rotate()
            self._write_lines(lines)
        except OSError:
            self.errors += 1

    def close(self) -> None:
        for worker in list(self._steps):
            t = self._steps[worker][0]
            self._flush_steps(worker, t)
        self.flush()
        if self._fh is not None:
            self._fh.close()
            self._fh = None

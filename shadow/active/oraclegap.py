"""BR-H's gap to the offline Oracle on the recent window of finished requests (a mirror listener).

`OracleGap` keeps the last `window` mirrored requests that finished normally (arrival, prompt
tokens, true output tokens, prompt key). `compute(jobs)` replays that window offline through two
lanes on the same engine (G workers × B slots, the lanes' step model): BR-H with its online
survival predictor, and BR-H with the Oracle predictor (true remaining lengths, the offline upper
bound). The gap is BR-H's average spread over the Oracle's, minus 1 (0 = as good as knowing every
length). It is CPU work: run it off the mirror's thread, every minute or so (`ModeControl` does).
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Hashable, Sequence

from shadow.contracts.events import Arrive, Cancel, Event, Finish, Route
from shadow.core.params import BRParams
from shadow.core.stepmodel import StepTimeModel
from shadow.engine.config import EngineConfig, LaneSpec
from shadow.engine.jobs import Job
from shadow.engine.offline import run_offline

LANES = (LaneSpec("brh", "survival"), LaneSpec("brh", "oracle"))


class OracleGap:
    """See module docstring."""

    def __init__(self, workers: int, slots: int, step: StepTimeModel, br: BRParams, *, window: int = 300,
                 min_jobs: int = 50, max_open: int = 100_000) -> None:
        self.config = EngineConfig(workers=workers, slots=slots, step=step, br=br)
        self.window = window
        self.min_jobs = min_jobs
        self.max_open = max_open
        self.open: OrderedDict[str, tuple[float, int, Hashable | None]] = OrderedDict()
        self.done: deque[Job] = deque(maxlen=window)
        self.finished = 0  # requests added since start (the window moves when this grows)

    def __call__(self, ev: Event) -> None:
        if isinstance(ev, Arrive):
            self.open[ev.request_id] = (ev.t, ev.prompt_tokens or 0, ev.prompt_key)
            if len(self.open) > self.max_open:
                self.open.popitem(last=False)
        elif isinstance(ev, Route):
            got = self.open.get(ev.request_id)
            if got is not None and not got[1] and ev.prompt_tokens:
                self.open[ev.request_id] = (got[0], ev.prompt_tokens, got[2])
        elif isinstance(ev, Finish):
            got = self.open.pop(ev.request_id, None)
            if got is not None and ev.generated and ev.reason in ("stop", "length"):
                self.done.append(Job(ev.request_id, got[0], max(got[1], 1), ev.generated, got[2]))
                self.finished += 1
        elif isinstance(ev, Cancel):
            self.open.pop(ev.request_id, None)

    def jobs(self) -> list[Job]:
        """The window, in arrival order, times from 0 (call on the mirror's thread)."""
        jobs = sorted(self.done, key=lambda j: j.arrival_s)
        if not jobs:
            return []
        t0 = jobs[0].arrival_s
        return [Job(i, j.arrival_s - t0, j.prompt_tokens, j.output_tokens, j.prompt_key)
                for i, j in enumerate(jobs)]

    def compute(self, jobs: Sequence[Job]) -> float | None:
        """BR-H spread / Oracle spread − 1 on `jobs`; None with fewer than `min_jobs` or an idle
        Oracle lane. Pure CPU (any thread)."""
        if len(jobs) < self.min_jobs:
            return None
        res = run_offline(list(jobs), self.config, LANES, time.perf_counter)
        brh, oracle = (res[s.label].avg_spread_tokens for s in LANES)
        if oracle <= 0:
            return None
        return brh / oracle - 1.0

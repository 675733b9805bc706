"""The shared, barrier-synchronised step clock of a group of decode engines (DP ranks).

Per step: every live engine admits waiting requests into free slots, then the step lasts
max_g (a·L_g + b + c1·P_g)·slow_g × time_scale, where L_g is rank g's load (Σ prompt + generated
over its running requests), P_g the prompt tokens it prefilled locally this step and slow_g its
slow-step fault multiplier (idle live ranks count with L_g = 0, as DP ranks run dummy batches in
lockstep); at the end every running request of every rank gets one token.
A stall on any rank stops the whole group (as a hung rank stops a DP collective). The clock
sleeps while no rank has work; `poke()` wakes it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

from shadow.core.stepmodel import StepTimeModel
from shadow.fleet.engine import DecodeEngine
from shadow.fleet.metrics import ITL_BUCKETS, Hist


class StepClock:
    """Drives `engines` in lockstep; run `run()` as one task."""

    def __init__(
        self, engines: Sequence[DecodeEngine], model: StepTimeModel, *, time_scale: float, prefill_c1: float
    ) -> None:
        self.engines = list(engines)
        self.model = model
        self.time_scale = time_scale
        self.prefill_c1 = prefill_c1
        self.steps = 0
        self.last_step_s = 0.0  # wall duration of the last step
        self.last_max_load = 0
        self.sum_spread = 0  # Σ over steps of max_g L_g − min_g L_g (live ranks): ground-truth spread
        self.step_hist = Hist(ITL_BUCKETS)
        self._wake = asyncio.Event()

    def poke(self) -> None:
        self._wake.set()

    async def _nap(self, timeout: float | None) -> None:
        self._wake.clear()
        if timeout is None:
            await self._wake.wait()
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        a, b, c1 = self.model.a, self.model.b, self.prefill_c1
        engines = self.engines
        prefilled = [0] * len(engines)
        planned_end: float | None = None  # deadline of the previous step while steps run back to back
        while True:
            now = loop.time()
            stall_until = max((e.faults.stall_until for e in engines if e.up), default=0.0)
            if stall_until > now:
                planned_end = None
                await self._nap(stall_until - now)
                continue
            worst = 0.0
            max_load = 0
            min_load: int | None = None
            busy = False
            for i, e in enumerate(engines):
                if not e.up:
                    prefilled[i] = 0
                    continue
                prefilled[i] = e.admit(now) if e.waiting else 0
                min_load = e.load if min_load is None else min(min_load, e.load)
                if e.running:
                    busy = True
                    max_load = max(max_load, e.load)
                # idle live ranks run dummy batches in lockstep (cost b, times their slow factor)
                t = (a * e.load + b + c1 * prefilled[i]) * e.faults.slow
                if t > worst:
                    worst = t
            if not busy:
                planned_end = None
                await self._nap(None)
                continue
            dt = worst * self.time_scale
            # Timer and event-loop latency (~1 ms) would lengthen every step: a step that starts
            # late by less than its own duration is shortened by that lateness, so that step times
            # average to the model.
            start = now
            if planned_end is not None and 0.0 < now - planned_end < dt:
                start = planned_end
            planned_end = start + dt
            await asyncio.sleep(planned_end - now)
            end = loop.time()
            for i, e in enumerate(engines):
                if e.up and (e.running or prefilled[i]):
                    e.finish_step(end, prefilled[i])
            self.steps += 1
            self.last_step_s = end - start
            self.step_hist.observe(end - start)
            self.last_max_load = max_load
            self.sum_spread += max_load - (min_load or 0)

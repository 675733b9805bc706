"""The shared, barrier-synchronised step clock of a group of decode engines (DP ranks).

Per step: every live engine schedules (admits waiting requests into free slots, under its token
budget and KV cache: `DecodeEngine.admit`), then the step lasts
max_g (a·L_g + b + c1·P_g)·slow_g × time_scale, where L_g is rank g's load (Σ prompt + generated
over its running requests), P_g the prompt tokens it prefilled locally this step and slow_g its
slow-step fault multiplier (idle live ranks count with L_g = 0, as DP ranks run dummy batches in
lockstep); at the end every running request of every rank gets one token.
A stall on any rank stops the whole group (as a hung rank stops a DP collective). The clock
sleeps while no rank has work; `poke()` wakes it.

Back to back, a step that starts late by less than its own duration is shortened by that
lateness (timer latency does not lengthen steps on average). With `max_behind_s` > 0 (`shadow fleet
--catch-up S`) the clock keeps the model's timeline up to S seconds behind: a step starts where
the previous one was planned to end, however late this process woke, so after a hiccup of a busy
host the steps it held up end at once (their tokens leave in a burst, as a GPU's queued outputs
would) and step times average to the model. Lateness not made up is counted in
`behind_dropped_s`; a clock with no work forgets its timeline.
Occupancy: `busy_slot_steps` / `slot_steps` (requests running after admission, over the live
ranks' slots, summed over steps) says whether a run was saturated in the fleet's own terms.
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
        self,
        engines: Sequence[DecodeEngine],
        model: StepTimeModel,
        *,
        time_scale: float,
        prefill_c1: float,
        max_behind_s: float = 0.0,
    ) -> None:
        self.engines = list(engines)
        self.max_behind_s = max_behind_s
        self.model = model
        self.time_scale = time_scale
        self.prefill_c1 = prefill_c1
        self.steps = 0
        self.last_step_s = 0.0  # wall time from the previous step's end (or this one's start) to its end
        self.last_max_load = 0
        self.sum_spread = 0  # Σ over steps of max_g L_g − min_g L_g (live ranks): ground-truth spread
        self.busy_slot_steps = 0  # Σ over steps of requests running (after admission): occupancy
        self.slot_steps = 0  # Σ over steps of the live ranks' slots
        self.model_s = 0.0  # Σ over steps of the model's step time (× time_scale)
        self.wall_s = 0.0  # Σ over steps of their wall duration
        self.behind_dropped_s = 0.0  # lateness given up (beyond max_behind_s): the model's time lost
        self.behind_max_s = 0.0  # the most the clock was behind its timeline
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
        planned_end: float | None = None  # planned end of the previous step while steps run back to back
        last_end = 0.0  # when the previous step really ended
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
                prefilled[i] = e.admit(now)  # (every step: a prefill may go on, a preemption be due)
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
            busy_slots = sum(len(e.running) for e in engines if e.up)
            slots = sum(e.slots for e in engines if e.up)
            # Back to back: on the timeline (see module docstring).
            start = now
            if planned_end is not None:
                behind = now - planned_end
                self.behind_max_s = max(self.behind_max_s, behind)
                if 0.0 < behind < dt or 0.0 < behind <= self.max_behind_s:
                    start = planned_end
                elif behind > 0.0:
                    self.behind_dropped_s += behind
            back_to_back = planned_end is not None
            planned_end = start + dt
            await asyncio.sleep(max(0.0, planned_end - now))
            end = loop.time()
            for i, e in enumerate(engines):
                if e.up and (e.running or prefilled[i]):
                    e.finish_step(end, prefilled[i])
            # the step as its tokens show it: from the previous step's tokens (or from its start)
            took = end - (last_end if back_to_back else now)
            last_end = end
            self.steps += 1
            self.last_step_s = took
            self.model_s += dt
            self.wall_s += took
            self.step_hist.observe(took)
            self.last_max_load = max_load
            self.sum_spread += max_load - (min_load or 0)
            self.busy_slot_steps += busy_slots
            self.slot_steps += slots

"""A lane's barrier groups: their clocks, and the finishes booked (or still open) on their steps.

The workers form barrier groups (`EngineConfig.clock`; default one group). `BarrierClock` keeps per
group its members (`groups`; `group_of` per worker), its step count (`gk`), the start of its next
step (`gnow`: the end of its last one), its running requests (`grun`), the finishes booked by its
step index (`calendars`: (worker, slot, job, output tokens)), live the requests whose end is still
open (`watches`: a heap of (last step known not to end it, tie, worker, slot, job)), and the
requests started for its next step (`started`: their first token comes at its end). `models` are
the per-worker step models of the clock in force (None: the config's one model).

It owns no slot or load: the slots' start steps and output lengths are passed in where a booking
reads or writes them. `regroup` moves every request's bookings to its worker's new group and
returns the steps each worker's count moved by (the slots and the engine scheduler follow). Pure.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Hashable, Sequence
from typing import Protocol

import numpy as np
import numpy.typing as npt

from shadow.core.stepmodel import StepTimeModel
from shadow.engine.jobs import Job

Booking = tuple[int, int, Job, int]  # (worker, slot, job, output tokens)
Watch = tuple[int, int, int, int, Job]  # (last step known not to end it, tie, worker, slot, job)
Int64s = npt.NDArray[np.int64]


class EndSource(Protocol):
    """Live driver: what is known of a request's real output so far.

    `end_of(request_id)` is (tokens generated so far, final output length or None while the real
    stream has not ended); the final length, once given, is >= every earlier count.
    """

    def end_of(self, request_id: Hashable) -> tuple[int, int | None]: ...


class BarrierClock:
    """See module docstring."""

    __slots__ = ("calendars", "gk", "gnow", "group_of", "groups", "grun", "models", "started",
                 "watch_seq", "watches")

    def __init__(self, workers: int) -> None:
        self.groups: list[tuple[int, ...]] = [tuple(range(workers))]
        self.group_of: list[int] = [0] * workers
        self.models: tuple[StepTimeModel, ...] | None = None
        self.gk: list[int] = [0]
        self.gnow: list[float] = [0.0]
        self.grun: list[int] = [0]
        self.calendars: list[dict[int, list[Booking]]] = [{}]
        self.watches: list[list[Watch]] = [[]]
        self.watch_seq = 0
        self.started: list[list[tuple[int, Job]]] = [[]]

    def reset(self, at: float) -> None:
        """Nothing running or booked (a re-seed); every group's next step starts at `at`."""
        n_groups = len(self.groups)
        self.calendars = [{} for _ in range(n_groups)]
        self.watches = [[] for _ in range(n_groups)]
        self.started = [[] for _ in range(n_groups)]
        self.grun = [0] * n_groups
        self.gnow = [at] * n_groups

    def next_group(self, queues: Sequence[deque[tuple[Job, float]]]) -> int | None:
        """The group with work (running, or waiting at its workers in `queues`) whose next step
        starts first (the paper's model: no request is on its way)."""
        if len(self.groups) == 1:
            return 0 if self.grun[0] or any(queues) else None
        best: int | None = None
        gnow, grun = self.gnow, self.grun
        for c, members in enumerate(self.groups):
            if (grun[c] or any(queues[g] for g in members)) and (best is None or gnow[c] < gnow[best]):
                best = c
        return best

    def book(self, g: int, slot: int, job: Job, start: int, age: int, ends: EndSource | None,
             slot_output: Int64s) -> None:
        """`job` in `slot` of worker g emits its first (next) token at the end of its group's step
        `start` + `age`: its finish is booked (offline, from the job; live, when `ends` knows its
        final length), its output length written to `slot_output`; else its end is watched."""
        if ends is None:
            out = max(job.output_tokens, age + 1)
        else:
            gen, final = ends.end_of(job.request_id)
            if final is None:
                slot_output[slot] = gen
                self.watch_seq += 1
                watch = self.watches[self.group_of[g]]
                heapq.heappush(watch, (start + gen - 2, self.watch_seq, g, slot, job))
                return
            out = max(final, gen, age + 1, 1)
        slot_output[slot] = out
        self.calendars[self.group_of[g]].setdefault(start + out - 1, []).append((g, slot, job, out))

    def unbook(self, c: int, slot: int, key: int) -> None:
        """Take the finish of the request in `slot`, booked for step `key`, out of group c's calendar
        (or its watch, when its end was open)."""
        entries = self.calendars[c].get(key)
        if entries is not None:
            for i, entry in enumerate(entries):
                if entry[1] == slot:
                    del entries[i]
                    if not entries:
                        del self.calendars[c][key]
                    return
        watch = [w for w in self.watches[c] if w[3] != slot]
        heapq.heapify(watch)
        self.watches[c] = watch

    def unknown_end(self, c: int, ends: EndSource, slot_start: Int64s, slot_output: Int64s) -> bool:
        """Live: resolve the open ends group `c`'s step needs (booking those now known, their output
        written to `slot_output`); True when one is still unknown (hold)."""
        watch, k = self.watches[c], self.gk[c]
        end_of, refile = ends.end_of, heapq.heapreplace  # (bound once: every running request
        # of a lane at the edge of the known tokens is looked at again each time its count moves)
        # Each open end is looked at once at most: it is resolved, re-filed under a step >= k, or
        # holds the step. The loop is bounded by that count rather than left open-ended.
        for _ in range(len(watch)):
            if not watch:
                break
            top = watch[0]
            if top[0] >= k:
                break
            _, n, g, slot, job = top
            gen, final = end_of(job.request_id)
            start = int(slot_start[slot])
            if final is not None:
                heapq.heappop(watch)
                done = max(start + max(final, gen, 1) - 1, k)
                self.calendars[c].setdefault(done, []).append((g, slot, job, done - start + 1))
                slot_output[slot] = done - start + 1
                continue
            key = start + gen - 2
            if key < k:
                return True
            refile(watch, (key, n, g, slot, job))
        return False

    def regroup(self, groups: list[tuple[int, ...]], running: Sequence[int]) -> list[int] | None:
        """Step from now on in `groups`, keeping every request's progress: a merged group starts its
        next step when its slowest member ends its current one; a split group's workers start theirs
        where the group would have. Returns the steps added to each worker's count (None: the same
        groups, nothing changed)."""
        if groups == self.groups:
            return None
        g_count = len(self.group_of)
        old_of, old_k, old_now = self.group_of, self.gk, self.gnow
        worker_k = [old_k[old_of[g]] for g in range(g_count)]
        new_of = [0] * g_count
        for c, members in enumerate(groups):
            for g in members:
                new_of[g] = c
        new_k = [max(worker_k[g] for g in members) for members in groups]
        delta = [new_k[new_of[g]] - worker_k[g] for g in range(g_count)]  # steps added per worker
        calendars: list[dict[int, list[Booking]]] = [{} for _ in groups]
        for cal in self.calendars:
            for k, entries in cal.items():
                for entry in entries:
                    w = entry[0]
                    calendars[new_of[w]].setdefault(k + delta[w], []).append(entry)
        watches: list[list[Watch]] = [[] for _ in groups]
        for watch in self.watches:
            for k, n, w, slot, job in watch:
                watches[new_of[w]].append((k + delta[w], n, w, slot, job))
        for watch in watches:
            heapq.heapify(watch)
        started: list[list[tuple[int, Job]]] = [[] for _ in groups]
        for jobs in self.started:
            for w, job in jobs:
                started[new_of[w]].append((w, job))
        self.groups, self.group_of, self.gk = groups, new_of, new_k
        self.gnow = [max(old_now[old_of[g]] for g in members) for members in groups]
        self.grun = [sum(running[g] for g in members) for members in groups]
        self.calendars, self.watches, self.started = calendars, watches, started
        return delta

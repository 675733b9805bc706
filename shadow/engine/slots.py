"""A lane's G·B request slots: which slot holds which request, and what the policies predict of them.

`SlotTable` keeps one entry per slot (worker g owns slots g·B … g·B + B − 1) in flat arrays: whether
it is taken (`active`), its request's prompt tokens, the step (of its worker's barrier group) its
age counts from (`start`: age = the group's step count − start), its output length when known
(`output`), its prompt key (for the predictors), and the predicted steps left (`steps`, as of the
group's step `ref`). The free slots of each worker are a stack (`take` pops, `give` pushes back).

It also answers what is read off the slots with a predictor: BR-H's `projection` (predictions
refreshed every `refresh_steps` lane steps), BRA's `stay_basis`, and a newcomer's predicted
contribution (`newcomer_steps`). It knows nothing of the barrier clock but what it is told: the
groups' step counts (`gk`) and, after a regrouping, each slot's group (`regroup`). Pure.
"""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np
import numpy.typing as npt

from shadow.core.fscore import Projection
from shadow.core.predictors import Predictor, contribution
from shadow.core.stay import StayBasis, predicted_basis
from shadow.engine.jobs import Job


def _free_stacks(workers: int, slots: int) -> list[list[int]]:
    """Each worker's free slots, lowest on top (popped first)."""
    return [list(range((w + 1) * slots - 1, w * slots - 1, -1)) for w in range(workers)]


class SlotTable:
    """See module docstring. The arrays are updated in place, never replaced (a lane may alias them)."""

    __slots__ = ("active", "free", "group", "horizon", "key", "last_refresh", "output", "predictor",
                 "prompt", "ref", "refresh_steps", "slots", "start", "steps", "worker", "workers")

    def __init__(self, workers: int, slots: int, predictor: Predictor | None, horizon: int,
                 refresh_steps: int) -> None:
        n = workers * slots
        self.workers, self.slots = workers, slots
        self.predictor, self.horizon, self.refresh_steps = predictor, horizon, refresh_steps
        self.active = np.zeros(n, dtype=bool)
        self.prompt = np.zeros(n, dtype=np.float64)
        self.start = np.zeros(n, dtype=np.int64)
        self.output = np.zeros(n, dtype=np.int64)
        self.steps = np.zeros(n, dtype=np.float64)  # ĉ at its reference step
        self.ref = np.zeros(n, dtype=np.int64)
        self.key: list[Hashable | None] = [None] * n
        self.worker = np.repeat(np.arange(workers, dtype=np.int64), slots)
        self.group = np.zeros(n, dtype=np.int64)
        self.free = _free_stacks(workers, slots)
        self.last_refresh = -(10**9)

    def reset(self) -> None:
        """Every slot free (a re-seed)."""
        self.free = _free_stacks(self.workers, self.slots)
        self.active[:] = False
        self.key = [None] * (self.workers * self.slots)
        self.last_refresh = -(10**9)

    def take(self, g: int, job: Job, start: int, k: int) -> int:
        """A free slot of worker g for `job`, its age counted from step `start` (its group at step k)."""
        slot = self.free[g].pop()
        self.active[slot] = True
        self.prompt[slot] = job.prompt_tokens
        self.start[slot] = start
        self.key[slot] = job.prompt_key
        if self.predictor is not None:
            steps = self.newcomer_steps(job)
            self.steps[slot] = self.horizon if steps is None else steps
            self.ref[slot] = k
        return slot

    def give(self, g: int, slot: int) -> None:
        """`slot` of worker g is free again."""
        self.active[slot] = False
        self.key[slot] = None
        self.free[g].append(slot)

    def regroup(self, delta: list[int], group_of: list[int]) -> None:
        """The barrier groups changed: worker g's step count moved by `delta[g]`; `group_of` per worker."""
        shift = np.asarray(delta, dtype=np.int64)[self.worker]
        self.start += shift
        self.ref += shift
        self.group = np.asarray(group_of, dtype=np.int64)[self.worker]

    def slot_steps(self, gk: list[int]) -> npt.NDArray[np.int64]:
        """Per slot: the step count of its worker's group (`gk`: per group)."""
        return np.asarray(gk, dtype=np.int64)[self.group]

    def newcomer_steps(self, job: Job) -> float | None:
        """A new request's predicted contribution over the horizon (None without a predictor)."""
        if self.predictor is None:
            return None
        h = self.horizon
        p, mu = self.predictor.predict(
            np.zeros(1, dtype=np.int64),
            h,
            keys=[job.prompt_key],
            remaining=np.asarray([job.output_tokens], dtype=np.int64),
        )
        return float(contribution(p, mu, h)[0])

    def projection(self, gk: list[int], k: int) -> Projection:
        """BR-H's active requests: (worker, load, predicted steps left), predictions refreshed every
        `refresh_steps` lane steps (`k`: the lane's step count; needs a predictor)."""
        idx = np.flatnonzero(self.active)
        ks = self._ks(idx, gk)
        age = ks - self.start[idx]
        if k - self.last_refresh >= self.refresh_steps:
            self._refresh(idx, age, ks, k)
        w = self.prompt[idx] + age
        c = np.maximum(self.steps[idx] - (ks - self.ref[idx]), 0.0)
        return self.worker[idx], w, c

    def stay_basis(self, kind: str, gk: list[int]) -> StayBasis | None:
        """BRA's predicted thin-pool basis `kind` over the running requests (shadow.core.stay);
        None without a predictor or with the oracle (it knows no fleet-wide length distribution)."""
        if self.predictor is None or self.predictor.name == "oracle":
            return None
        idx = np.flatnonzero(self.active)
        age = self._ks(idx, gk) - self.start[idx]
        keys = [self.key[i] for i in idx.tolist()]
        return predicted_basis(
            kind,
            self.predictor,
            self.workers,
            self.worker[idx],
            self.prompt[idx] + age,
            age,
            self.horizon,
            keys=keys,
            remaining=self.output[idx] - age,
        )

    def _ks(self, idx: npt.NDArray[np.int64], gk: list[int]) -> npt.NDArray[np.int64] | int:
        """The step count of each slot's group (one group: the lane's step count)."""
        if len(gk) == 1:
            return gk[0]
        return np.asarray(gk, dtype=np.int64)[self.group[idx]]

    def _refresh(
        self, idx: npt.NDArray[np.int64], age: npt.NDArray[np.int64], ks: npt.NDArray[np.int64] | int, k: int
    ) -> None:
        assert self.predictor is not None
        h = self.horizon
        keys = [self.key[i] for i in idx.tolist()]
        remaining = self.output[idx] - age
        p, mu = self.predictor.predict(age, h, keys=keys, remaining=remaining)
        self.steps[idx] = contribution(p, mu, h)
        self.ref[idx] = ks
        self.last_refresh = k

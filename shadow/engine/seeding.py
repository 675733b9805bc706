"""Rolling windows' seeds and the live request table: a seed taken from the table at a boundary,
and a seed turned back into the jobs a lane re-seeds with (`rolling.Seed`, `Lane.reseed`). Pure
functions of their arguments; the table (and the driver's assignments) are updated where a seed
names a request the table does not hold (a replay)."""

from __future__ import annotations

from collections.abc import Hashable, Mapping, MutableMapping

from shadow.engine.jobs import Job
from shadow.engine.livetable import LiveRequest
from shadow.engine.rolling import Seed, Seeded


def take_seed(n: int, reqs: Mapping[str, LiveRequest], origin: float, window_s: float, budget: int) -> Seed:
    """Seed n from the table as it is now (the events before boundary n: the fleet at it): every
    placed request not ended, in arrival order, with the step budget so far."""
    held = tuple(sorted(
        (Seeded(rid, r.worker, r.arrival, r.prompt, r.generated if r.running else 0, r.key)
         for rid, r in reqs.items()
         if r.queued and r.final is None and r.worker is not None and r.prompt is not None
         and r.arrival is not None),
        key=lambda s: (s.arrival, s.request_id),
    ))
    return Seed(n, origin + n * window_s, origin, window_s, held, budget)


def seed_jobs(seed: Seed, index: Mapping[str, int], reqs: MutableMapping[str, LiveRequest],
              assign: MutableMapping[Hashable, int], origin: float,
              ) -> tuple[list[tuple[int, Job, int]], list[tuple[Job, float]], int]:
    """The requests of `seed` as a lane re-seeds with them: (worker, job, tokens generated) of the
    running ones, (job, arrival) of the waiting ones, and how many name a worker not configured
    (left out). Each is assigned its worker; one the table does not hold (a replay: in flight when
    the recording ended, its end never known) enters the table."""
    running: list[tuple[int, Job, int]] = []
    waiting: list[tuple[Job, float]] = []
    unknown = 0
    for s in seed.requests:
        g = index.get(s.worker)
        if g is None:
            unknown += 1
            continue
        r = reqs.get(s.request_id)
        if r is None:  # a replay: in flight when the recording ended (its end never known)
            r = reqs[s.request_id] = LiveRequest(s.worker, s.prompt, s.key, s.generated,
                                                 arrival=s.arrival, queued=True,
                                                 running=s.generated >= 1)
        assign[s.request_id] = g
        job = Job(s.request_id, s.arrival - origin, max(1, s.prompt), 1, s.key, r.body_bytes)
        if s.generated >= 1:
            running.append((g, job, s.generated))
        else:
            waiting.append((job, job.arrival_s))
    return running, waiting, unknown

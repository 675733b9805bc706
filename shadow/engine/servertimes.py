"""What a real server does around its engine's steps, measured per worker from its engine probe's
steps (running, tokens, period, KV usage after each step) and its requests' events (placed, ended):
the lanes' twin of the server beyond the step-cost model. Pure: times come in as arguments.

- Which steps admitted and finished requests. With `r0`/`r1` the running counts before/after a
  step: finished = the requests it computed − r1 (a probe with the engine's iteration details
  says how many it computed; else its `tokens`, the sequences that produced one, which misses a
  finish beside a prefill that goes on), joined = finished + r1 − r0 (what joined the running set,
  less what the step preempted: none joins in a step that preempts), of which as many as the probe
  counts preemptions are resumed ones (vLLM counts a preemption when the request next produces a
  token: at its resume), the rest admissions. vLLM admits FIFO, so the k-th
  admission of a worker is its k-th placed request (a request that ended before any token never
  reached it and is taken out); stream ends are paired with finishing steps in order (a mean over
  the pairs does not depend on which end goes with which step).
- `front(g)`: from a request's placement to the start of the step that admitted it, over the
  admissions made while nothing waited in the engine (its own queue is the lane's to model):
  the HTTP front end and input processing. `back(g)`: from the step that finished a request to its
  stream's end where the events see it (output processing, the HTTP side, the tap). Means over the
  last `memory` samples: the load a lane holds is a time integral, which a mean gets right.
- `speed(g, t)`: the host's speed — measured step periods over what the worker's step model
  predicts for the same steps (their sequences, prefill tokens and KV), per `bucket_s` of event time;
  a step of any lane at that time takes its model's time × this factor, so the lanes keep the
  measured timeline (a shared host's contention is the same whatever the policy) while the model
  keeps what depends on the state. 1 where nothing was measured.
- `kv_blocks(g)`, `block_tokens(g)`: the KV cache the engine reports its usage of (a fraction of
  its blocks): its blocks are the inverse of the smallest rise of usage (a decoding request that
  starts a block), and the block size the one that most lone admissions' prompts fill to the rise
  of usage each made (vLLM's CPU build: 128; GPU: 16): usage × blocks × block size is the KV it
  holds in tokens.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from shadow.core.stepmodel import StepTimeModel

BUCKET_S = 0.5  # event time per speed factor
MEMORY = 256  # latency and capacity samples kept per worker
MAX_LATENCY_S = 30.0  # a pairing further apart than this is a broken pairing, not a latency
SPEED_RANGE = (0.2, 5.0)  # the host speed factor is kept within this
MIN_BUCKET_STEPS = 3  # steps a bucket needs for a factor of its own
LOOKBACK_BUCKETS = 8  # a bucket without one takes the latest one this close before it
BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)  # the KV block sizes looked for
MIN_KV_SAMPLES = 5  # lone admissions before a block size is named


@dataclass
class _Worker:
    placed: deque[tuple[float, str, float]] = field(default_factory=deque)  # (t, id, prompt) not admitted
    admits: deque[tuple[float, bool, float | None]] = field(default_factory=deque)  # (start, quiet, rise)
    prompt_sum: float = 0.0  # placed prompts paired so far
    prompt_n: int = 0
    ends: deque[float] = field(default_factory=deque)  # stream ends not paired with a finishing step
    finished: deque[float] = field(default_factory=deque)  # finishing steps not paired with an end
    running: int = 0  # after its last step
    waiting: int = 0
    kv_usage: float = 0.0
    front: deque[float] = field(default_factory=lambda: deque(maxlen=MEMORY))
    back: deque[float] = field(default_factory=lambda: deque(maxlen=MEMORY))
    lone: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=MEMORY))  # (prompt, rise)
    quantum: float = 1.0  # the smallest rise of KV usage seen: one block
    lone_seen: int = 0  # lone admissions taken (the block size is named again when it moves)
    block: tuple[int, float, int | None] = (-1, 0.0, None)  # (lone_seen, quantum, block size) last named
    buckets: dict[int, list[float]] = field(default_factory=dict)  # bucket -> [Σ measured, Σ predicted, n]


class ServerTimes:
    """See module docstring. `placed`/`ended` per request, `step` per probe step; `models` are the
    workers' step models the speed factor is measured against (`set_models`)."""

    def __init__(self, workers: int, models: Sequence[StepTimeModel], *, bucket_s: float = BUCKET_S,
                 keep_buckets: int = 512) -> None:
        if bucket_s <= 0:
            raise ValueError(f"speed bucket must be > 0 s, got {bucket_s}")
        self.w = [_Worker() for _ in range(workers)]
        self.bucket_s = bucket_s
        self.keep_buckets = keep_buckets
        self.models = list(models)
        self.steps = 0  # probe steps taken (with counts)
        self.desyncs = 0  # pairings dropped as impossible (a placement never admitted, a lost step)
        self.set_models(models)

    def set_models(self, models: Sequence[StepTimeModel]) -> None:
        if len(models) != len(self.w):
            raise ValueError(f"{len(models)} step models for {len(self.w)} workers")
        self.models = list(models)

    # -- requests --------------------------------------------------------------------------------

    def placed(self, g: int, t: float, request_id: str, prompt: float) -> None:
        """A request placed on worker g at event time t (in placement order per worker)."""
        placed = self.w[g].placed
        placed.append((t, request_id, prompt))
        while t - placed[0][0] > MAX_LATENCY_S:  # never admitted (no probe, a lost step): no pair
            placed.popleft()
            self.desyncs += 1

    def ended(self, g: int, t: float, request_id: str, generated: int) -> None:
        """A request of worker g ended at t: its stream's end when it generated tokens (the engine
        finished it), else it never reached the engine (out of the admission order)."""
        w = self.w[g]
        if generated >= 1:
            w.ends.append(t)
            self._pair_ends(w)
            _expire(w.ends, t, self)  # ends no finishing step came for (no probe, a lost step)
            return
        for i, (_, rid, _) in enumerate(w.placed):
            if rid == request_id:
                del w.placed[i]
                return

    # -- steps -----------------------------------------------------------------------------------

    def step(self, g: int, t: float, period: float, running: int, waiting: int, tokens: int,
             preemptions: int, kv_usage: float | None, load: float, *, scheduled: int | None = None,
             prefill_tokens: int | None = None) -> None:
        """A probe step of worker g that ended at t, `period` after its previous one, with the
        counts after it; `load`: the KV tokens the worker held (the mirror's), for the model;
        `scheduled`: the requests it computed (prefilling and decoding; then a finish is exact
        even beside a chunked prefill), `prefill_tokens` the prompt tokens among them."""
        w = self.w[g]
        self.steps += 1
        finished = max(0, (tokens if scheduled is None else scheduled) - running)
        joined = max(0, finished + running - w.running)  # (less the step's preemptions, not known)
        start = t - period
        resumed = min(joined, preemptions)  # vLLM counts a preemption at the request's resume
        new = joined - resumed
        rise = None
        if kv_usage is not None:
            if kv_usage - w.kv_usage > 1e-9:
                rise = kv_usage - w.kv_usage
                w.quantum = min(w.quantum, rise)
            w.kv_usage = kv_usage
        lone = rise if new == 1 and not resumed and not finished else None
        for _ in range(new):
            w.admits.append((start, w.waiting == 0, lone))
        prompt = self._pair_admits(w, new)
        if prefill_tokens is not None:
            prompt = float(prefill_tokens)
        for _ in range(finished):
            w.finished.append(t)
        self._pair_ends(w)
        _expire(w.finished, t, self)  # finishing steps no stream end came for (an untapped stream)
        w.running, w.waiting = running, waiting
        if period > 0 and tokens > 0:
            b = int(t // self.bucket_s)
            acc = w.buckets.get(b)
            if acc is None:
                acc = w.buckets[b] = [0.0, 0.0, 0.0]
                if len(w.buckets) > self.keep_buckets:
                    del w.buckets[min(w.buckets)]
            acc[0] += period
            acc[1] += self.models[g].worker_time(load, tokens, prompt)
            acc[2] += 1

    def _pair_admits(self, w: _Worker, new: int) -> float:
        """Pair admissions with placements in order, each side waiting for the other (a probe's
        steps and the requests' events come in on their own paths); the prompt tokens the last
        `new` admissions brought (a mean placed prompt for one not paired yet). A pair that cannot
        be one (admitted before placed; or too far apart) drops the side that has no partner."""
        placed, admits = w.placed, w.admits
        prompts: list[float] = []
        while placed and admits:
            t_placed, _, p = placed[0]
            start, quiet, rise = admits[0]
            if start < t_placed - 0.05:  # an admission of a placement this never saw
                admits.popleft()
                self.desyncs += 1
                continue
            if start - t_placed > MAX_LATENCY_S:  # a placement that never reached the engine
                placed.popleft()
                self.desyncs += 1
                continue
            placed.popleft()
            admits.popleft()
            prompts.append(p)
            w.prompt_sum += p
            w.prompt_n += 1
            if quiet:  # nothing queued in the engine before it: no engine wait in it
                w.front.append(start - t_placed)
            if rise is not None and p > 0:
                w.lone.append((p, rise))
                w.lone_seen += 1
        if len(admits) > MEMORY:  # admissions of placements never seen (a lost event stream)
            admits.popleft()
            self.desyncs += 1
        mean = w.prompt_sum / w.prompt_n if w.prompt_n else 0.0
        unpaired = min(new, len(admits))
        return sum(prompts[len(prompts) - (new - unpaired):]) + unpaired * mean

    def _pair_ends(self, w: _Worker) -> None:
        while w.ends and w.finished:
            d = w.ends.popleft() - w.finished.popleft()
            if -0.05 <= d <= MAX_LATENCY_S:
                w.back.append(max(0.0, d))
            else:
                self.desyncs += 1

    # -- what the lanes use ----------------------------------------------------------------------

    def front(self, g: int) -> float | None:
        xs = self.w[g].front
        return max(0.0, statistics.fmean(xs)) if xs else None

    def back(self, g: int) -> float | None:
        xs = self.w[g].back
        return statistics.fmean(xs) if xs else None

    def kv_blocks(self, g: int) -> int | None:
        w = self.w[g]
        return round(1.0 / w.quantum) if w.quantum < 1.0 else None

    def block_tokens(self, g: int) -> int | None:
        """The block size most lone admissions agree with (None: too few yet)."""
        w = self.w[g]
        if w.block[:2] == (w.lone_seen, w.quantum):
            return w.block[2]
        blocks = self.kv_blocks(g)
        lone = w.lone
        bs: int | None = None
        if blocks is not None and len(lone) >= MIN_KV_SAMPLES:
            used = [(p, round(rise * blocks)) for p, rise in lone]
            bs = max(BLOCK_SIZES, key=lambda size: sum(1 for p, n in used if -(-p // size) == n))
        w.block = (w.lone_seen, w.quantum, bs)
        return bs

    def kv_tokens(self, g: int) -> float | None:
        """The KV cache of worker g in tokens (blocks × block size; None until both are known)."""
        blocks, bs = self.kv_blocks(g), self.block_tokens(g)
        return None if blocks is None or bs is None else float(blocks * bs)

    def speed(self, g: int, t: float) -> float:
        """The host speed factor of worker g at event time t (see module docstring)."""
        buckets = self.w[g].buckets
        b = int(t // self.bucket_s)
        for i in range(b, b - LOOKBACK_BUCKETS, -1):
            acc = buckets.get(i)
            if acc is not None and acc[2] >= MIN_BUCKET_STEPS and acc[1] > 0:
                lo, hi = SPEED_RANGE
                return min(hi, max(lo, acc[0] / acc[1]))
        return 1.0

    def latencies(self) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
        """(front, back) per worker once every worker has both (0 for a worker without samples
        while another has them), or None before any was measured."""
        fronts = [self.front(g) for g in range(len(self.w))]
        backs = [self.back(g) for g in range(len(self.w))]
        if all(x is None for x in fronts) and all(x is None for x in backs):
            return None
        return tuple(x or 0.0 for x in fronts), tuple(x or 0.0 for x in backs)

    def describe(self, names: Sequence[str]) -> dict[str, dict[str, float | int | None]]:
        """Per worker by name: its latencies, KV tokens, samples (for the report)."""
        out: dict[str, dict[str, float | int | None]] = {}
        for g, name in enumerate(names):
            w = self.w[g]
            out[name] = {"front_s": self.front(g), "back_s": self.back(g), "kv_tokens": self.kv_tokens(g),
                         "kv_block_tokens": self.block_tokens(g),
                         "front_samples": len(w.front), "back_samples": len(w.back)}
        return out


def _expire(times: deque[float], now: float, counts: ServerTimes) -> None:
    """Drop the times more than `MAX_LATENCY_S` before `now` (oldest first): no partner can come for
    them (a pairing further apart is broken); each counted in `desyncs`."""
    while times and now - times[0] > MAX_LATENCY_S:
        times.popleft()
        counts.desyncs += 1

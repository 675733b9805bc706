"""One simulated decode engine (a DP rank), scheduling as vLLM V1 does: B slots (--max-num-seqs)
with a FIFO waiting queue behind them, one token per running request per step; with a token budget
(--max-num-batched-tokens) running requests go first (one token per decoding request, the next
chunk of each prefilling one) and waiting ones are admitted while budget is left (a prompt that
does not fit is prefilled in chunks over several steps, its first token after the last); when the
KV cache (in blocks) cannot hold a step, the newest running request is preempted: its KV freed, it
waits at the front of the queue and recomputes prompt + generated tokens when admitted again.
Steps are driven by `StepClock`; the HTTP layer only submits and waits.

A `Seq` is one request inside an engine; readers wait on it with `wait_beyond(seen)`, which
returns once more tokens exist or the request finished (one future per waiting reader, set at
most once per step: no task or queue per token).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections import deque
from collections.abc import Callable
from typing import Any

from shadow.engine.kvcache import FreeBlocks
from shadow.fleet.config import FleetConfig
from shadow.fleet.faults import FaultState
from shadow.fleet.metrics import EngineStats

WAITING, RUNNING, FINISHED = 0, 1, 2
#: The fields of a `FleetConfig` that size each decode rank.
RANK_SIZE = ("slots", "kv_capacity_tokens", "block_size", "max_model_len", "max_num_batched_tokens")


class EngineDown(RuntimeError):
    """The engine crashed and does not accept requests."""


class Seq:
    """A request inside an engine: its sizes, progress and timestamps (event-loop seconds)."""

    __slots__ = (
        "_waiter",
        "arrival",
        "finish_reason",
        "finished_t",
        "first_t",
        "generated",
        "held_blocks",
        "kv_params",
        "last_t",
        "max_tokens",
        "natural_finish",
        "on_release",
        "prefill_left",
        "prompt_tokens",
        "rid",
        "scheduled_t",
        "source",
        "status",
        "target",
        "wake_each_token",
    )

    def __init__(
        self,
        rid: str,
        prompt_tokens: int,
        target: int,
        natural_finish: str,
        max_tokens: int,
        arrival: float,
        *,
        source: str = "local_compute",
        on_release: Callable[[], None] | None = None,
    ) -> None:
        self.rid = rid
        self.prompt_tokens = prompt_tokens
        self.target = target
        self.natural_finish = natural_finish
        self.max_tokens = max_tokens
        self.arrival = arrival
        self.source = source
        self.on_release = on_release
        self.generated = 0
        self.prefill_left = 0  # tokens of its (re)prefill after this step's chunk (0: decoding)
        self.held_blocks = 0  # preempted: the KV blocks it held then
        self.status = WAITING
        self.finish_reason: str | None = None
        self.kv_params: dict[str, Any] | None = None
        self.scheduled_t = 0.0
        self.first_t = 0.0
        self.last_t = 0.0
        self.finished_t = 0.0
        self.wake_each_token = True  # False: readers only want the end (non-streaming)
        self._waiter: asyncio.Future[None] | None = None

    @property
    def finished(self) -> bool:
        return self.status == FINISHED

    def notify(self) -> None:
        w = self._waiter
        if w is not None:
            self._waiter = None
            if not w.done():
                w.set_result(None)

    async def wait_beyond(self, seen: int) -> None:
        """Return when `generated > seen` or the request finished."""
        while self.generated <= seen and self.status != FINISHED:
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiter = fut
            await fut

    def release(self) -> None:
        """Run the release hook once (frees the prefill's KV for a P/D request)."""
        cb = self.on_release
        if cb is not None:
            self.on_release = None
            cb()


def finish_seq(seq: Seq, reason: str, now: float, stats: EngineStats) -> None:
    """Mark `seq` finished with `reason`, record its per-request metrics, wake its reader."""
    if seq.status == FINISHED:
        return
    was_scheduled = seq.status == RUNNING or seq.generated > 0
    seq.status = FINISHED
    seq.finish_reason = reason
    seq.finished_t = now
    seq.release()
    stats.success[reason] = stats.success.get(reason, 0) + 1
    stats.e2e.observe(now - seq.arrival)
    stats.req_prompt.observe(seq.prompt_tokens)
    stats.req_generation.observe(seq.generated)
    stats.req_max_tokens.observe(seq.max_tokens)
    stats.req_max_generation.observe(seq.max_tokens)
    stats.req_n.observe(1)
    if was_scheduled:
        stats.queue.observe(max(0.0, seq.scheduled_t - seq.arrival))
        stats.inference.observe(now - seq.scheduled_t)
        if seq.generated > 0:
            stats.prefill.observe(seq.first_t - seq.scheduled_t)
            stats.decode.observe(now - seq.first_t)
        if seq.generated > 1:
            stats.tpot.observe((now - seq.first_t) / (seq.generated - 1))
    seq.notify()


class DecodeEngine:
    """Running batch + FIFO waiting queue of one rank; `admit` and `finish_step` are the clock's."""

    def __init__(
        self,
        label: str,
        *,
        slots: int,
        kv_capacity_tokens: int,
        block_size: int,
        max_model_len: int,
        faults: FaultState,
        on_work: Callable[[], None],
        max_num_batched_tokens: int | None = None,
    ) -> None:
        self.engine_label = label
        self.slots = slots
        self.max_num_batched_tokens = max_num_batched_tokens
        self.kv_capacity_tokens = kv_capacity_tokens
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.faults = faults
        self._on_work = on_work
        self.running: list[Seq] = []
        self.waiting: deque[Seq] = deque()
        self.load = 0  # Σ (prompt + generated) over running requests: L_g
        self.last_step_end = 0.0
        self.up = True
        self._stats = EngineStats(max_model_len)
        self._cache = FreeBlocks(kv_capacity_tokens // block_size, block_size)  # free blocks (prefix cache)

    @classmethod
    def sized(
        cls, label: str, config: FleetConfig, faults: FaultState, on_work: Callable[[], None]
    ) -> DecodeEngine:
        """A rank sized by `config` (its `RANK_SIZE` fields)."""
        return cls(label, faults=faults, on_work=on_work, **{k: getattr(config, k) for k in RANK_SIZE})

    # -- MetricsSource ---------------------------------------------------------------------------
    @property
    def stats(self) -> EngineStats:
        return self._stats

    @stats.setter
    def stats(self, value: EngineStats) -> None:
        self._stats = value

    def num_running(self) -> int:
        return len(self.running)

    def num_waiting(self) -> int:
        return len(self.waiting)

    def kv_blocks(self, computed: bool = False) -> int:
        """Blocks the running requests hold: their prompt and tokens computed by the step scheduled
        (a decoding request's next token, a prefilling one's chunk); `computed`: before it (at the
        start of `admit`, nothing scheduled yet)."""
        bs = self.block_size
        if computed:
            return sum(-(-(s.prompt_tokens + s.generated - s.prefill_left - (not s.prefill_left)) // bs)
                       for s in self.running)
        return sum(-(-(s.prompt_tokens + s.generated - s.prefill_left) // bs) for s in self.running)

    def kv_usage(self) -> float:
        return min(1.0, self.kv_blocks() / max(1, self.kv_capacity_tokens // self.block_size))

    # -- requests --------------------------------------------------------------------------------
    def submit(self, seq: Seq) -> None:
        if not self.up:
            raise EngineDown(self.engine_label)
        self.waiting.append(seq)
        self._on_work()

    def abort(self, seq: Seq, now: float, reason: str = "abort") -> None:
        """Remove `seq` wherever it is and finish it with `reason` (no-op when finished)."""
        if seq.status == FINISHED:
            return
        if seq.status == WAITING:
            with contextlib.suppress(ValueError):
                self.waiting.remove(seq)
        else:
            try:
                self.running.remove(seq)
                self.load -= seq.prompt_tokens + seq.generated
                held = seq.prompt_tokens + seq.generated - seq.prefill_left
                self._cache.release(held)
            except ValueError:
                pass
        finish_seq(seq, reason, now, self._stats)

    def reset(self, now: float) -> None:
        """Crash: drop every request (finished as abort) and start with empty state and metrics."""
        for seq in [*self.running, *self.waiting]:
            if seq.status != FINISHED:
                seq.status = FINISHED
                seq.finish_reason = "abort"
                seq.finished_t = now
                seq.release()
                seq.notify()
        self.running = []
        self.waiting.clear()
        self.load = 0
        self._cache = FreeBlocks(self.kv_capacity_tokens // self.block_size, self.block_size)
        self._stats = EngineStats(self.max_model_len)

    # -- clock side ------------------------------------------------------------------------------
    def admit(self, now: float) -> int:
        """Schedule the next step (see module docstring): return the prompt tokens it prefills
        locally. Requests that go on prefilling after it (`prefill_left`) get no token from it."""
        running, waiting = self.running, self.waiting
        budget = math.inf if self.max_num_batched_tokens is None else float(self.max_num_batched_tokens)
        local = 0
        held = self.kv_blocks(computed=True)
        chunks: list[tuple[Seq, int]] = []
        for seq in running:
            if seq.prefill_left:
                chunks.append((seq, seq.prefill_left))
            else:
                budget -= 1
        planned: dict[str, int] = {}
        for seq, left in chunks:
            chunk = int(min(left, max(budget, 0.0)))
            seq.prefill_left = left - chunk
            planned[seq.rid] = chunk
            budget -= chunk
            local += chunk
        victims = self._preempt(planned)
        held -= sum(v.held_blocks for v in victims)
        cache = self._cache
        cache.allocate(self.kv_blocks() - held)  # the step's new blocks: decodes', chunks'
        if victims:  # nothing is admitted in a step that preempts (vLLM); their chunks are not in it
            return local - sum(planned.get(v.rid, 0) for v in victims)
        bs = self.block_size
        cap = self.kv_capacity_tokens // bs
        used = -1
        while waiting and len(running) < self.slots and budget > 0:
            seq = waiting[0]
            size = seq.prompt_tokens + seq.generated
            remote = seq.source != "local_compute" and not seq.generated  # its KV comes from a prefill
            if running:  # its whole sequence must fit (vLLM's scheduler_reserve_full_isl), not a chunk
                used = self.kv_blocks() if used < 0 else used
                if used + -(-size // bs) > cap:
                    break
            # a preempted request's blocks still cached: only the tokens past them are computed
            hit = cache.reclaim(seq.rid, size)
            chunk = size if remote else int(min(size - hit, budget))
            cache.allocate(-(-(hit + chunk) // bs) - hit // bs)
            used = used if used < 0 else used + -(-(hit + chunk) // bs)
            waiting.popleft()
            running.append(seq)
            seq.status = RUNNING
            if not seq.scheduled_t:
                seq.scheduled_t = now
            seq.prefill_left = size - hit - chunk
            self.load += size
            if not seq.generated:
                self._stats.add_prompt(seq.prompt_tokens, seq.source)
            if not remote:
                local += chunk
                budget -= chunk
            seq.release()
        return local

    def _preempt(self, planned: dict[str, int]) -> list[Seq]:
        """While the running requests' blocks for this step (a decoding request's next token, a
        prefilling one's chunk: `planned`) exceed the KV cache, preempt the newest (never the last
        one); the requests preempted (their blocks freed: the full ones stay cached for them)."""
        bs = self.block_size
        cap = self.kv_capacity_tokens // bs
        running = self.running
        victims: list[Seq] = []
        if self.load // bs + len(running) <= cap:  # cannot exceed it (each holds < 1 block spare)
            return victims
        while len(running) > 1 and self.kv_blocks() > cap:
            seq = running.pop()
            self.load -= seq.prompt_tokens + seq.generated
            if seq.rid in planned:  # prefilling: what it had computed before this step's chunk
                computed = seq.prompt_tokens + seq.generated - seq.prefill_left - planned[seq.rid]
            else:
                computed = seq.prompt_tokens + seq.generated - 1
            full, partial = divmod(computed, bs)
            seq.held_blocks = full + (1 if partial else 0)
            self._cache.release(computed, seq.rid)
            seq.status = WAITING
            seq.prefill_left = 0
            self.waiting.appendleft(seq)
            self._stats.preemptions += 1
            victims.append(seq)
        return victims

    def finish_step(self, now: float, prefilled: int) -> None:
        """End of a step: every running request but those still prefilling got one token; finish
        those that are done."""
        running = self.running
        n = len(running)
        st = self._stats
        st.iteration_tokens.observe(sum(1 for s in running if not s.prefill_left) + prefilled)
        if not n:
            self.last_step_end = now
            return
        itl_n = 0
        done = False
        emitted = 0
        for seq in running:
            if seq.prefill_left:  # its prefill goes on: no token from this step
                continue
            emitted += 1
            g = seq.generated + 1
            seq.generated = g
            seq.last_t = now
            if g == 1:
                seq.first_t = now
                st.ttft.observe(now - seq.arrival)
            else:
                itl_n += 1
            if g >= seq.target:
                done = True
            elif seq.wake_each_token:
                seq.notify()
        self.load += emitted
        st.generation_tokens += emitted
        if itl_n:
            st.itl.observe(now - self.last_step_end, itl_n)
        if done:
            keep: list[Seq] = []
            for seq in running:
                if seq.generated >= seq.target:
                    self.load -= seq.prompt_tokens + seq.generated
                    self._cache.release(seq.prompt_tokens + seq.generated - 1)
                    finish_seq(seq, seq.natural_finish, now, st)
                else:
                    keep.append(seq)
            self.running = keep
        self.last_step_end = now

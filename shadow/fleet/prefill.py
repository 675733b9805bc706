"""A simulated prefill server's engine: P/D prefills first-come first-served, one at a time,
each taking (c0 + c1·prompt_tokens)·slow × time_scale, producing one token and a KV hold
(`KvStore`); requests that are not P/D prefills run on a private one-rank decode engine, as a
kv_producer vLLM instance serves ordinary requests too.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque

from shadow.fleet.clock import StepClock
from shadow.fleet.config import FleetConfig
from shadow.fleet.engine import FINISHED, RUNNING, DecodeEngine, EngineDown, Seq, finish_seq
from shadow.fleet.faults import FaultState
from shadow.fleet.metrics import EngineStats
from shadow.fleet.pd import KvStore


class PrefillEngine:
    """FCFS prefill queue + KV store + private decode engine of one prefill server."""

    engine_label = "0"

    def __init__(self, config: FleetConfig, faults: FaultState, kv: KvStore) -> None:
        self.config = config
        self.faults = faults
        self.kv = kv
        self.queue: deque[Seq] = deque()
        self.current: Seq | None = None
        self.up = True
        self._wake = asyncio.Event()
        self.local = DecodeEngine.sized("0", config, faults, self._poke_local)
        self.local_clock = StepClock(
            [self.local], config.step_model, time_scale=config.time_scale, prefill_c1=config.prefill_c1
        )

    def _poke_local(self) -> None:
        self.local_clock.poke()

    def poke(self) -> None:
        self._wake.set()
        self.local_clock.poke()

    # -- MetricsSource ---------------------------------------------------------------------------
    @property
    def stats(self) -> EngineStats:
        return self.local.stats

    def num_running(self) -> int:
        return (self.current is not None) + self.local.num_running()

    def num_waiting(self) -> int:
        return len(self.queue) + self.local.num_waiting()

    def kv_usage(self) -> float:
        self.kv.sweep(asyncio.get_running_loop().time())
        bs = self.config.block_size
        blocks = self.kv.held_blocks() + self.local.kv_blocks()
        if self.current is not None:
            blocks += -(-self.current.prompt_tokens // bs)
        return min(1.0, blocks / max(1, self.config.kv_capacity_tokens // bs))

    # -- requests --------------------------------------------------------------------------------
    def submit_prefill(self, seq: Seq) -> None:
        if not self.up:
            raise EngineDown("prefill")
        self.queue.append(seq)
        self._wake.set()

    def abort(self, seq: Seq, now: float) -> None:
        if seq.status == FINISHED:
            return
        if seq in self.queue:
            self.queue.remove(seq)
        elif seq is not self.current:
            self.local.abort(seq, now)
            return
        finish_seq(seq, "abort", now, self.stats)

    def reset(self, now: float) -> None:
        """Crash: lose queued prefills, held KV, the private engine's requests and the metrics."""
        for seq in [*self.queue, *([self.current] if self.current else [])]:
            if seq.status != FINISHED:
                seq.status = FINISHED
                seq.finish_reason = "abort"
                seq.notify()
        self.queue.clear()
        self.current = None
        self.kv.reset()
        self.local.reset(now)

    async def run(self) -> None:
        """The FCFS prefill loop (run as one task, beside `local_clock.run()`)."""
        loop = asyncio.get_running_loop()
        cfg = self.config
        while True:
            now = loop.time()
            if not self.queue:
                self._wake.clear()
                await self._wake.wait()
                continue
            if self.faults.stalled(now):
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self.faults.stall_until - now)
                continue
            seq = self.queue.popleft()
            self.current = seq
            seq.status = RUNNING
            seq.scheduled_t = now
            dt = (cfg.prefill_c0 + cfg.prefill_c1 * seq.prompt_tokens) * self.faults.slow * cfg.time_scale
            await asyncio.sleep(dt)
            if self.current is not seq:  # crashed meanwhile
                continue
            self.current = None
            if seq.status == FINISHED:  # aborted while prefilling
                continue
            end = loop.time()
            st = self.stats
            st.add_prompt(seq.prompt_tokens, "local_compute")
            st.generation_tokens += 1
            st.iteration_tokens.observe(seq.prompt_tokens + 1)
            st.ttft.observe(end - seq.arrival)
            seq.generated = 1
            seq.first_t = seq.last_t = end
            seq.kv_params = self.kv.issue(seq.rid, seq.prompt_tokens, end)
            finish_seq(seq, "length", end, st)

"""The simulated fleet's decode engine schedules as vLLM V1 does — its waiting queue behind the
slots, the token budget with chunked prefill, recompute preemption when its KV blocks run out —
and exactly as the lanes' engine models it: on the same requests, step by step, the same running
and waiting counts, KV blocks and finishes (the twin of the simulated fleet is exact)."""

from __future__ import annotations

import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shadow.core.stepmodel import StepTimeModel
from shadow.engine.config import EngineConfig, EngineLimits, LaneSpec
from shadow.engine.jobs import Job
from shadow.engine.lane import Lane
from shadow.fleet.engine import DecodeEngine, Seq
from shadow.fleet.faults import FaultState

pytestmark = pytest.mark.timeout(120)


def _fleet_run(reqs: list[tuple[int, int, int]], slots: int, budget: int | None, kv: int, block: int
               ) -> tuple[list[tuple[int, int, int]], dict[str, int], int]:
    """(running, waiting, blocks) after each step of a fleet engine, each request's finishing step
    and the preemptions; `reqs` = (submit step, prompt, output)."""
    engine = DecodeEngine("0", slots=slots, kv_capacity_tokens=kv, block_size=block, max_model_len=1 << 20,
                          faults=FaultState(), on_work=lambda: None, max_num_batched_tokens=budget)
    seqs = [Seq(f"r{i}", p, o, "length", o, float(k)) for i, (k, p, o) in enumerate(reqs)]
    series: list[tuple[int, int, int]] = []
    done: dict[str, int] = {}
    step = 0
    while len(done) < len(seqs):
        for seq, (k, _, _) in zip(seqs, reqs, strict=True):
            if k == step:
                engine.submit(seq)
        prefilled = engine.admit(float(step))
        engine.finish_step(float(step + 1), prefilled)
        series.append((engine.num_running(), engine.num_waiting(), engine.kv_blocks(computed=True)))
        for seq in seqs:
            if seq.finished and seq.rid not in done:
                done[seq.rid] = step
        step += 1
        assert step < 10_000
    return series, done, engine.stats.preemptions


def _lane_run(reqs: list[tuple[int, int, int]], slots: int, budget: int | None, kv: int, block: int
              ) -> tuple[list[tuple[int, int, int]], dict[str, int], int]:
    limits = EngineLimits(max_num_batched_tokens=budget, kv_tokens=kv, block_tokens=block)
    config = EngineConfig(workers=1, slots=slots, step=StepTimeModel(0.0, 1.0), limits=limits)
    forced: dict[object, int] = {f"r{i}": 0 for i in range(len(reqs))}
    lane = Lane(LaneSpec("forced"), config, time.perf_counter, forced=forced)  # type: ignore[arg-type]
    done: dict[str, int] = {}
    at = [0]
    lane.on_done = lambda rid: done.setdefault(str(rid), at[0])
    series: list[tuple[int, int, int]] = []
    pending = sorted((k, i) for i, (k, _, _) in enumerate(reqs))
    step = 0
    while len(done) < len(reqs):
        at[0] = step
        while pending and pending[0][0] == step:
            _, i = pending.pop(0)
            lane.offer(Job(f"r{i}", float(step), reqs[i][1], reqs[i][2]), float(step))
        lane.now = float(step)
        if not lane.step():  # nothing to run: an idle step (the fleet's clock does not step then)
            series.append((0, 0, 0))
            step += 1
            continue
        series.append((lane.running[0], lane.engine_waiting()[0], lane.kv_blocks(0)))
        step += 1
        assert step < 10_000
    return series, done, lane.preemptions


requests = st.lists(st.tuples(st.integers(0, 30), st.integers(1, 120), st.integers(1, 25)), min_size=1,
                    max_size=14)


@settings(max_examples=60, deadline=None)
@given(reqs=requests, slots=st.integers(1, 4), budget=st.one_of(st.none(), st.integers(4, 150)),
       kv_blocks=st.integers(12, 60), block=st.sampled_from([4, 16]))
def test_the_fleets_engine_and_the_lanes_schedule_the_same_steps(
        reqs: list[tuple[int, int, int]], slots: int, budget: int | None, kv_blocks: int, block: int) -> None:
    if budget is not None:
        budget = max(budget, slots)
    # the cache holds the longest request alone (vLLM refuses one that it cannot)
    kv = max(kv_blocks, max(-(-(p + o) // block) for _, p, o in reqs) + 1) * block
    fleet_series, fleet_done, fleet_pre = _fleet_run(reqs, slots, budget, kv, block)
    lane_series, lane_done, lane_pre = _lane_run(reqs, slots, budget, kv, block)
    assert lane_done == fleet_done
    assert lane_pre == fleet_pre
    n = len(fleet_series)
    assert lane_series[:n] == fleet_series


def test_a_long_prompt_is_prefilled_in_chunks_beside_decodes() -> None:
    rng = random.Random(1)
    reqs = [(0, 30, 40), (0, 30, 40), (3, 500, 5)] + [(rng.randint(4, 20), 50, 10) for _ in range(3)]
    _, done, _ = _fleet_run(reqs, slots=4, budget=64, kv=1 << 20, block=16)
    # the 500-token prompt, admitted at step 3 beside two decodes, is prefilled in ceil(500 / 62) =
    # 9 steps, the last of which gives its first token; its 4 more tokens take 4 more steps
    assert done["r2"] - 3 == (9 - 1) + 4
    _, lane_done, _ = _lane_run(reqs, slots=4, budget=64, kv=1 << 20, block=16)
    assert lane_done == done

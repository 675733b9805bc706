"""The lane engine scheduling as vLLM V1 does (`EngineLimits`, step terms per sequence and prefill
token, server latencies, host speed): with nothing that binds it goes through exactly the paper
path's steps; each thing that binds does what vLLM's scheduler does (its waiting queue behind the
slots, the token budget with chunked prefill, recompute preemption when KV runs out)."""

from __future__ import annotations

import math
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shadow.core.stepmodel import StepTimeModel
from shadow.engine.config import EngineConfig, EngineLimits, LaneClock, LaneSpec
from shadow.engine.jobs import Job
from shadow.engine.lane import Lane
from tests.engine.helpers import loads_from_slots, run_lane

UNIT = StepTimeModel(a=0.0, b=1.0)


def _lane(policy: str = "forced", workers: int = 1, slots: int = 4, step: StepTimeModel = UNIT,
          limits: EngineLimits | None = None, forced: dict[object, int] | None = None,
          clock: LaneClock | None = None) -> Lane:
    config = EngineConfig(workers=workers, slots=slots, step=step, limits=limits, clock=clock)
    if policy == "forced" and forced is None:
        forced = {}
    return Lane(LaneSpec(policy), config, time.perf_counter, forced=forced)  # type: ignore[arg-type]


class _Ends:
    """Records each request's finish time and what the lane held at every step."""

    def __init__(self, lane: Lane) -> None:
        self.lane = lane
        self.at: dict[object, float] = {}
        lane.on_done = lambda rid: self.at.setdefault(rid, lane.totals.last_finish_s)


def _figures(lane: Lane) -> tuple[object, ...]:
    t = lane.totals
    return (t.steps, t.tokens, t.finished, round(t.busy_time_s, 9), t.sum_spread, t.sum_imbalance,
            round(t.sum_idle_s, 9), round(t.last_finish_s, 9), sorted(round(x, 9) for x in t.ttft_s))


jobs_strategy = st.lists(
    st.tuples(st.floats(0.0, 5.0), st.integers(1, 300), st.integers(1, 12)), min_size=1, max_size=25)


@settings(max_examples=40, deadline=None)
@given(raw=jobs_strategy, policy=st.sampled_from(["jsq-bytes", "br0", "rr"]), workers=st.integers(1, 3))
def test_engine_mode_without_binding_limits_is_the_paper_path(
        raw: list[tuple[float, int, int]], policy: str, workers: int) -> None:
    # Unbounded limits switch the engine path on; nothing in it binds, so every step, token,
    # finish and time is the paper path's.
    jobs = [Job(i, a, p, o) for i, (a, p, o) in enumerate(sorted(raw))]
    ready = [j.arrival_s for j in jobs]
    step = StepTimeModel(a=1e-3, b=0.05)
    paper = _lane(policy, workers, slots=2, step=step)
    engine = _lane(policy, workers, slots=2, step=step, limits=EngineLimits())
    assert not paper._engine and engine._engine
    run_lane(paper, jobs, ready)
    run_lane(engine, jobs, ready)
    assert _figures(engine) == _figures(paper)


def test_the_engines_waiting_queue_is_fifo_behind_its_slots() -> None:
    # max-num-seqs 2: of five requests at once, two run; each finish admits the oldest waiting
    lane = _lane(slots=2, limits=EngineLimits(), forced=dict.fromkeys("abcde", 0))
    ends = _Ends(lane)
    for i, rid in enumerate("abcde"):
        lane.offer(Job(rid, 0.0, 10, 2 + i), 0.0)
    running = []
    while lane.step():
        running.append(lane.running[0])
        assert lane.running[0] <= 2
        assert lane.loads == loads_from_slots(lane)
    # a: 2 steps, b: 3 steps (c admitted at step 3, d when c or b ends, ...), one token per step each
    assert list(ends.at) == ["a", "b", "c", "d", "e"]
    assert ends.at == {"a": 2.0, "b": 3.0, "c": 6.0, "d": 8.0, "e": 12.0}
    assert lane.totals.tokens == sum(2 + i for i in range(5))


def test_a_prompt_over_the_token_budget_is_prefilled_in_chunks() -> None:
    # budget 100, a 250-token prompt alone: chunks of 100, 100, 50; its first token at the end of
    # the third step; the two steps before it emit nothing (counted as silent), each priced p·chunk
    model = StepTimeModel(a=0.0, b=1.0, p=0.01)
    lane = _lane(step=model, limits=EngineLimits(max_num_batched_tokens=100), forced={"x": 0})
    ends = _Ends(lane)
    lane.offer(Job("x", 0.0, 250, 3), 0.0)
    times = []
    while lane.step():
        times.append(lane.now)
    assert times == pytest.approx([2.0, 4.0, 5.5, 6.5, 7.5])  # 1 + 0.01·(100, 100, 50), then b
    assert lane.silent_steps == 2
    assert lane.totals.tokens == 3
    assert ends.at["x"] == pytest.approx(7.5)
    assert list(lane.totals.ttft_s) == pytest.approx([5.5])


def test_prefill_chunks_take_the_budget_decodes_leave() -> None:
    # three decoding requests and a budget of 10: a new 20-token prompt gets 7 tokens, then 7, 6
    lane = _lane(slots=8, step=StepTimeModel(a=0.0, b=1.0, p=1.0),
                 limits=EngineLimits(max_num_batched_tokens=10),
                 forced={"d1": 0, "d2": 0, "d3": 0, "new": 0})
    for rid in ("d1", "d2", "d3"):
        lane.offer(Job(rid, 0.0, 1, 50), 0.0)
    assert lane.step()  # the three prefill together (3 tokens of budget)
    lane.offer(Job("new", lane.now, 20, 5), lane.now)
    spent = []
    for _ in range(3):
        before = lane.now
        assert lane.step()
        spent.append(lane.now - before - 1.0)  # p = 1 s per prefill token
    assert spent == pytest.approx([7.0, 7.0, 6.0])
    assert lane.running[0] == 4 and not lane.sched.prefilling[0]


def test_kv_exhaustion_preempts_the_newest_request_which_recomputes_and_finishes() -> None:
    # 4 blocks of 4 tokens: two requests of 6-token prompts fit (2 blocks each) until the older
    # one's ninth token needs a third block: the newer is preempted, waits at the front of the
    # queue, and when the older ends comes back, prefilling prompt + its tokens so far
    limits = EngineLimits(kv_tokens=16, block_tokens=4)
    model = StepTimeModel(a=0.0, b=1.0, p=0.1)
    lane = _lane(step=model, limits=limits, forced={"old": 0, "new": 0})
    ends = _Ends(lane)
    lane.offer(Job("old", 0.0, 6, 6), 0.0)
    assert lane.step()
    lane.offer(Job("new", lane.now, 6, 10), lane.now)
    while lane.step():
        assert lane.running[0] <= 2
        assert lane.kv_blocks(0) <= 4
        assert lane.loads == loads_from_slots(lane)
    assert lane.preemptions >= 1
    assert set(ends.at) == {"old", "new"} and lane.totals.finished == 2
    assert lane.totals.tokens >= 16  # every token of both (recomputed ones are not re-emitted)
    assert ends.at["old"] < ends.at["new"]


def test_a_lone_request_that_outgrows_the_cache_is_never_preempted() -> None:
    # vLLM would have rejected it; the lane lets the last running request overflow rather than loop
    lane = _lane(limits=EngineLimits(kv_tokens=8, block_tokens=4), forced={"big": 0})
    lane.offer(Job("big", 0.0, 6, 20), 0.0)
    while lane.step():
        pass
    assert lane.totals.finished == 1 and lane.preemptions == 0


def test_front_latency_delays_admission_and_back_latency_keeps_the_request_placed() -> None:
    lane = _lane(forced={"r": 0})
    lane.set_latency([0.25], [2.0])
    lane.offer(Job("r", 0.0, 10, 3), 0.0)
    assert lane.placed_loads() == [10.0] and lane.engine_waiting() == [0]  # on its way
    assert lane.step()  # starts at 0.25, when it reaches the engine
    assert lane.now == pytest.approx(1.25)
    while lane.step():
        pass
    end = lane.now
    assert end == pytest.approx(3.25) and lane.loads == [0.0]
    assert lane.placed_loads() == [13.0]  # its stream has not ended: prompt + 3 tokens still placed
    lane.now = end + 2.0
    assert lane.placed_loads() == [0.0]


def test_step_price_has_the_per_sequence_and_prefill_terms() -> None:
    model = StepTimeModel(a=0.001, b=0.5, c=0.25, p=0.01)
    lane = _lane(step=model, forced=dict.fromkeys("ab", 0))
    lane.offer(Job("a", 0.0, 100, 5), 0.0)
    lane.offer(Job("b", 0.0, 50, 5), 0.0)
    assert lane.step()  # both admitted: L = 150, n = 2, P = 150
    assert lane.now == pytest.approx(0.001 * 150 + 0.25 * 2 + 0.01 * 150 + 0.5)
    before = lane.now
    assert lane.step()  # decoding: L = 152, n = 2, P = 0
    assert lane.now - before == pytest.approx(0.001 * 152 + 0.25 * 2 + 0.5)


def test_host_speed_scales_every_step() -> None:
    lane = _lane(forced={"r": 0})
    lane.set_speed(lambda g, t: 2.0 if t < 4 else 0.5)
    lane.offer(Job("r", 0.0, 10, 4), 0.0)
    times = []
    while lane.step():
        times.append(lane.now)
    assert times == pytest.approx([2.0, 4.0, 4.5, 5.0])


def test_independent_workers_admit_on_their_own_boundaries_with_latency() -> None:
    # two servers without a barrier, 1 s and 3 s steps; a request on its way to the slow one waits
    # for it (no step runs early on its account)
    clock = LaneClock.independent(2, [StepTimeModel(0.0, 1.0), StepTimeModel(0.0, 3.0)])
    lane = _lane(workers=2, clock=clock, limits=EngineLimits(), forced={"a": 0, "b": 1})
    lane.set_latency([0.0, 0.5], [0.0, 0.0])
    ends = _Ends(lane)
    lane.offer(Job("a", 0.0, 5, 3), 0.0)
    lane.offer(Job("b", 0.0, 5, 2), 0.0)
    while lane.step():
        pass
    assert ends.at == {"a": 3.0, "b": 6.5}


@settings(max_examples=30, deadline=None)
@given(raw=jobs_strategy, budget=st.integers(8, 200), kv=st.integers(2, 40),
       block=st.sampled_from([1, 4, 16]), front=st.floats(0.0, 0.5))
def test_every_request_finishes_with_all_its_tokens_under_any_limits(
        raw: list[tuple[float, int, int]], budget: int, kv: int, block: int, front: float) -> None:
    jobs = [Job(i, a, p, o) for i, (a, p, o) in enumerate(sorted(raw))]
    limits = EngineLimits(max_num_batched_tokens=budget, kv_tokens=max(kv * block, block), block_tokens=block)
    lane = _lane("jsq-bytes", workers=2, slots=3, step=StepTimeModel(0.0, 0.1, 0.01, 1e-3), limits=limits)
    lane.set_latency([front, 0.0], [0.0, front])

    def check(ln: Lane) -> None:
        assert all(r <= 3 for r in ln.running)
        assert ln.loads == pytest.approx(loads_from_slots(ln))

    run_lane(lane, jobs, [j.arrival_s for j in jobs], on_step=check)
    assert lane.totals.finished == len(jobs)
    assert lane.totals.tokens == sum(j.output_tokens for j in jobs)
    assert all(x == pytest.approx(0.0, abs=1e-6) for x in lane.loads)
    assert not any(lane.queues) and math.isfinite(lane.now)

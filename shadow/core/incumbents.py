"""The incumbents' own DP-rank routing rules, as shadow's baselines bind them: one request at a time.

Each rule is what a production router computes per request, read in its source (the summary lines
of `shadow.core.policies` name repository, file and the PR that set the current form; facts and
where they were read: ../shared/reference/incumbents-2026.md). Each reads the load a router knows:
its own ledger (requests it sent and has not seen finish: always current) and what the engines
publish of themselves (running, waiting, KV tokens, KV usage: as old as its view, `StaleView`),
and each adds its own optimistic increment to the chosen rank (`charge`) until the next refresh.

What the lanes cannot give exactly is said where it is approximated: SMG's word count (the lanes
hold tokens, not text: `WORDS_PER_TOKEN`), vLLM's KV usage (0 — no penalty — unless the fleet's
KV cache size is known, `KV_CAPACITY`), TRT-LLM's per-iteration batches (a lane routes a request
at its arrival: a batch of one, so its longest-first order has no effect). Pure: no clock, no I/O.
"""

from __future__ import annotations

import math
import random

from shadow.core.baselines import Baseline, BindState

#: vLLM's KV-pressure penalty on waiting requests: 6·waiting·max(0, usage − 0.5) (PR #49204).
VLLM_KV_PENALTY = 6.0
VLLM_KV_FREE = 0.5
#: vLLM's legacy score 4·waiting + running.
VLLM_LEGACY_WAITING = 4
#: SMG's per-dispatch estimate: ceil(1.3 × whitespace words) of the request text.
SMG_TOKENS_PER_WORD = 1.3
#: Words per prompt token where the text is not at hand (about 0.75 English words per BPE token).
WORDS_PER_TOKEN = 0.75


class VllmDP(Baseline):
    """vLLM's `DPLBAsyncMPClient` since PR #49204: per engine
    score = max(client_count·inflight, waiting + running) + 6·waiting·max(0, kv_usage − 0.5)
    (the penalty only with requests waiting), the lowest score wins, scanned from a start index
    that moves on by one at every decision (PR #47420), so ties go to the first engine from there.
    inflight is the client's own count (one client: client_count = 1); waiting/running/kv_usage
    are the coordinator's published stats, and the client adds client_count to the chosen engine's
    waiting count until the next publication."""

    name = "vllm-dp"
    engines = True

    def __init__(self, rng: random.Random) -> None:
        super().__init__(rng)
        self._start = 0

    def score(self, state: BindState, g: int) -> float:
        waiting = state.waiting[g]
        score = float(max(state.outstanding[g], waiting + state.running[g]))
        if waiting:
            score += waiting * VLLM_KV_PENALTY * max(0.0, state.kv_usage[g] - VLLM_KV_FREE)
        return score

    def pick(self, state: BindState, prompt_tokens: int, only_free: bool = False) -> int:
        cands = set(self.candidates(state, only_free))
        n = state.workers
        best, best_score = -1, math.inf
        for offset in range(n):
            g = (self._start + offset) % n
            if g in cands:
                s = self.score(state, g)
                if s < best_score:
                    best, best_score = g, s
        self._start = (self._start + 1) % n
        return best

    def charge(self, state: BindState, g: int, prompt_tokens: int) -> None:
        super().charge(state, g, prompt_tokens)
        state.waiting[g] += 1


class VllmDPLegacy(Baseline):
    """vLLM's `DPLBAsyncMPClient` before PR #49204: score = 4·waiting + running from the
    coordinator's published counts, the lowest wins, ties to the lowest engine index (the scan as
    it stood before PR #47420 rotated its start); +1 waiting at the chosen engine until the next
    publication."""

    name = "vllm-dp-legacy"
    engines = True

    def pick(self, state: BindState, prompt_tokens: int, only_free: bool = False) -> int:
        cands = self.candidates(state, only_free)
        return min(cands, key=lambda g: (VLLM_LEGACY_WAITING * state.waiting[g] + state.running[g], g))

    def charge(self, state: BindState, g: int, prompt_tokens: int) -> None:
        super().charge(state, g, prompt_tokens)
        state.waiting[g] += 1


class SglangTotalTokens(Baseline):
    """SGLang's DP controller, `--load-balance-method total_tokens` (`DPBudget.dispatch`): the rank
    with the fewest total tokens (KV tokens held plus prompt tokens queued: the scheduler's
    `num_total_tokens`), ties to fewer requests (running + waiting), then to the lowest rank; adds
    the request's input length and one request to the chosen rank until the next refresh (PR
    #21699)."""

    name = "sglang-tokens"
    engines = True

    def pick(self, state: BindState, prompt_tokens: int, only_free: bool = False) -> int:
        cands = self.candidates(state, only_free)
        return min(cands, key=lambda g: (state.kv_tokens[g], state.running[g] + state.waiting[g], g))

    def charge(self, state: BindState, g: int, prompt_tokens: int) -> None:
        super().charge(state, g, prompt_tokens)  # kv_tokens += input length
        state.waiting[g] += 1


class SglangTotalRequests(Baseline):
    """SGLang's DP controller, `--load-balance-method total_requests`: the rank with the fewest
    requests (running + waiting, from its snapshot), ties to the lowest rank; +1 request at the
    chosen rank until the next refresh."""

    name = "sglang-requests"
    engines = True

    def pick(self, state: BindState, prompt_tokens: int, only_free: bool = False) -> int:
        cands = self.candidates(state, only_free)
        return min(cands, key=lambda g: (state.running[g] + state.waiting[g], g))

    def charge(self, state: BindState, g: int, prompt_tokens: int) -> None:
        super().charge(state, g, prompt_tokens)
        state.waiting[g] += 1


def smg_estimate(prompt_tokens: int) -> int:
    """SMG's per-dispatch cost, ceil(1.3 × whitespace words), with words = round(0.75 × tokens)."""
    words = round(WORDS_PER_TOKEN * prompt_tokens)
    return math.ceil(SMG_TOKENS_PER_WORD * words)


class SmgMinTokens(Baseline):
    """SMG's `--dp-minimum-tokens-scheduler` (`WorkerLoadManager.select_and_increment_lowest_dp_load`):
    the rank with the fewest cached `num_used_tokens` (KV tokens its running requests hold), ties
    to the lowest rank; the chosen rank's cached count grows by `smg_estimate` until the next load
    poll replaces it."""

    name = "smg-min-tokens"
    engines = True

    def pick(self, state: BindState, prompt_tokens: int, only_free: bool = False) -> int:
        cands = self.candidates(state, only_free)
        return min(cands, key=lambda g: (state.kv_used[g], g))

    def charge(self, state: BindState, g: int, prompt_tokens: int) -> None:
        super().charge(state, g, prompt_tokens)
        state.kv_used[g] += smg_estimate(prompt_tokens)


class TrtllmADP(Baseline):
    """TensorRT-LLM's `DefaultADPRouter`: a min-heap over ranks keyed (Σ prompt lengths of its
    active requests, its active request count, rank); ranks holding `expected` active requests or
    more are left out, expected = max(ceil((Σ active + new) / G), max active) (no rank at the
    engines' `max_num_active_requests` here: the lanes' engines queue); the chosen rank gains the
    prompt length and one request. Its view is the iteration's allgather: current (age 0)."""

    name = "trtllm-adp"

    def pick(self, state: BindState, prompt_tokens: int, only_free: bool = False) -> int:
        cands = self.candidates(state, only_free)
        active = state.outstanding
        g_count = state.workers
        expected = max(-(-(sum(active) + 1) // g_count), max(active))
        eligible = [g for g in cands if active[g] < expected] or cands
        return min(eligible, key=lambda g: (state.outstanding_tokens[g], active[g], g))

"""The free blocks of a KV cache as vLLM V1's block pool keeps them, for what a preempted request
finds again when it resumes (prefix caching: on by default).

Free blocks wait in one queue (vLLM 0.32's `BlockPool.free_blocks`): at its front the blocks no
prefix can match — never used, or freed without a hash (a request's last, partly filled block) —
then the full blocks of requests that ended or were preempted (hashed: cached), in the order they
were freed (a request's last full block first: its prompt's blocks stay longest). An allocation
takes blocks from the front, evicting what a cached block held. A preempted request's full blocks
stay cached until evicted: when it resumes, those still there are a prefix-cache hit (only the
tokens past them are computed again), and it takes them back out of the queue. Only counts are
kept: which request's blocks, and how many of them are left. Pure.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable


class FreeBlocks:
    """See module docstring: `allocate`, `release` (or `free`), `reclaim` per request; `blocks` the
    cache's size, `block_tokens` a block's."""

    __slots__ = ("_freed", "_owned", "block_tokens", "blocks", "unhashed")

    def __init__(self, blocks: int, block_tokens: int) -> None:
        self.blocks = blocks
        self.block_tokens = block_tokens
        self.unhashed = blocks  # at the queue's front: never used, or freed without a hash
        self._freed: deque[list[object]] = deque()  # [owner or None, count], oldest first
        self._owned: dict[Hashable, list[object]] = {}

    def allocate(self, n: int) -> None:
        """Take `n` free blocks from the front (unhashed ones first, then the oldest freed)."""
        if n <= 0:
            return
        take = min(n, self.unhashed)
        self.unhashed -= take
        n -= take
        freed = self._freed
        while n > 0 and freed:
            group = freed[0]
            count = group[1]
            assert isinstance(count, int)
            used = min(n, count)
            group[1] = count - used
            n -= used
            if group[1] == 0:
                freed.popleft()
                owner = group[0]
                if owner is not None:
                    self._owned.pop(owner, None)

    def release(self, tokens: int, owner: Hashable | None = None) -> None:
        """The blocks of a request that computed `tokens` tokens, freed: its partly filled last block
        (no hash) to the front, its full ones to the back (`free`; under a preempted request's
        `owner` they stay cached for it)."""
        full, partial = divmod(max(0, tokens), self.block_tokens)
        self.unhashed += 1 if partial else 0
        self.free(full, owner)

    def free(self, n: int, owner: Hashable | None = None) -> None:
        """`n` full (hashed) blocks to the back of the queue; a preempted request's under its
        `owner` (they stay cached for it), anything else's without one."""
        if n <= 0:
            return
        group: list[object] = [owner, n]
        self._freed.append(group)
        if owner is not None:
            self._owned[owner] = group

    def reclaim(self, owner: Hashable, tokens: int) -> int:
        """The prefix-cache hit, in tokens, of `owner` resuming with `tokens` tokens: its blocks still
        cached, at most (tokens - 1) // block_tokens of them (vLLM computes at least the last token),
        taken out of the queue; cached blocks of it past those stay where they are, no one's."""
        group = self._owned.pop(owner, None)
        if group is None:
            return 0
        count = group[1]
        assert isinstance(count, int)
        hit = min(count, max(0, tokens - 1) // self.block_tokens)
        group[0] = None
        group[1] = count - hit  # an empty group is popped when reached
        return hit * self.block_tokens

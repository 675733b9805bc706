"""What the offline engine replays: jobs with ground truth the policies never see up front."""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass

from shadow.contracts.traces import TraceRequestLike
from shadow.core.baselines import BODY_BYTES_PER_TOKEN


@dataclass(frozen=True, slots=True)
class Job:
    """One request: arrival, prompt size, true output length (revealed to policies at finish);
    `body_bytes`: its request body's size in bytes where a tap saw it (None: traces, older
    recordings)."""

    request_id: Hashable
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    prompt_key: Hashable | None = None
    body_bytes: int | None = None

    @property
    def forwarded_bytes(self) -> float:
        """What the vllm-ascend proxy's JSQ rule charges for it: `body_bytes`, else the estimate
        BODY_BYTES_PER_TOKEN × prompt tokens (the order of prompt tokens: the rule before bodies)."""
        size = BODY_BYTES_PER_TOKEN * self.prompt_tokens if self.body_bytes is None else self.body_bytes
        return float(size)


def jobs_from(requests: Iterable[TraceRequestLike]) -> list[Job]:
    """Jobs numbered in order from anything with arrival_s/prompt_tokens/output_tokens/prompt_key
    (and body_bytes, where it has one: a recorded session's requests; traces have none)."""
    out: list[Job] = []
    last = float("-inf")
    for i, r in enumerate(requests):
        if r.arrival_s < last:
            raise ValueError(f"request {i}: arrival {r.arrival_s} is before the previous one ({last})")
        if r.prompt_tokens < 0 or r.output_tokens < 1:
            raise ValueError(f"request {i}: prompt_tokens must be >= 0 and output_tokens >= 1")
        last = r.arrival_s
        out.append(Job(i, float(r.arrival_s), int(r.prompt_tokens), int(r.output_tokens), r.prompt_key,
                       getattr(r, "body_bytes", None)))
    return out

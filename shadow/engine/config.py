"""Engine configuration: fleet shape, step model and barrier groups, prefill stage, lanes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from shadow.core.bra import BRAParams
from shadow.core.params import BRParams
from shadow.core.policies import REGISTRY, format_age, lookup, parse_age
from shadow.core.predictors import PREDICTORS
from shadow.core.stepmodel import StepTimeModel


@dataclass(frozen=True, slots=True)
class PrefillConfig:
    """N prefill servers, FCFS each; a prompt of s tokens takes c0 + c1·s seconds."""

    servers: int = 4
    c0_s: float = 0.020
    c1_s_per_token: float = 2.0e-5

    def __post_init__(self) -> None:
        if self.servers < 1:
            raise ValueError(f"prefill servers must be >= 1, got {self.servers}")
        if self.c0_s < 0 or self.c1_s_per_token < 0:
            raise ValueError("prefill times must be >= 0")


DEFAULT_BLOCK_TOKENS = 16  # vLLM's KV block on GPUs (its CPU build: 128)


@dataclass(frozen=True, slots=True)
class EngineLimits:
    """What a vLLM-like engine does between a request's arrival at a worker and its tokens, beyond
    the paper's B slots (vLLM's --max-num-seqs), as vLLM V1's scheduler does it (None: unbounded,
    the paper's model).

    `max_num_batched_tokens` (--max-num-batched-tokens): every step's token budget. Running requests
    come first, in admission order: one token per decoding request, a prefill chunk of what is
    left of its prompt per prefilling one; then waiting requests are admitted (FIFO) while budget
    and slots are left, each with a first chunk of its prompt (chunked prefill: a prompt that does
    not fit is prefilled over several steps and emits its first token at the end of the last).
    `kv_tokens`: the KV cache of a worker, in blocks of `block_tokens`: when the running requests'
    tokens of a step do not fit, the newest running request is preempted (its KV freed; it goes back
    to the front of its worker's queue and recomputes prompt + generated tokens when admitted again:
    V1's recompute preemption), and nothing is admitted that step; a request is admitted only when
    blocks for its whole sequence are free (vLLM's `scheduler_reserve_full_isl`, on by default)."""

    max_num_batched_tokens: int | None = None
    kv_tokens: int | None = None
    block_tokens: int = DEFAULT_BLOCK_TOKENS

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max batched tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.block_tokens < 1:
            raise ValueError(f"KV block size must be >= 1 token, got {self.block_tokens}")
        if self.kv_tokens is not None and self.kv_tokens < self.block_tokens:
            raise ValueError(f"KV cache must hold at least one block ({self.block_tokens} tokens), got "
                             f"{self.kv_tokens}")

    @property
    def kv_blocks(self) -> int | None:
        """The KV cache of a worker in blocks (None: unbounded)."""
        return None if self.kv_tokens is None else self.kv_tokens // self.block_tokens


@dataclass(frozen=True, slots=True)
class LaneClock:
    """How decode workers step: `groups` partitions the workers into barrier groups (a group steps
    in lockstep; its step lasts max over its members of τ_g = a_g·L_g + c_g·n_g + p_g·P_g + b_g;
    groups step independently), with `models` per worker (None: the config's fleet-wide `step` for
    all)."""

    groups: tuple[tuple[int, ...], ...]
    models: tuple[StepTimeModel, ...] | None = None

    @classmethod
    def barrier(cls, workers: int, models: Sequence[StepTimeModel] | None = None) -> LaneClock:
        """One barrier over every worker (the paper's DP fleet)."""
        return cls((tuple(range(workers)),), None if models is None else tuple(models))

    @classmethod
    def independent(cls, workers: int, models: Sequence[StepTimeModel] | None = None) -> LaneClock:
        """No barrier: every worker steps on its own (independent servers)."""
        return cls(tuple((g,) for g in range(workers)), None if models is None else tuple(models))

    def check(self, workers: int) -> None:
        """ValueError unless `groups` partitions range(workers) and `models` has one per worker."""
        seen = sorted(g for group in self.groups for g in group)
        if seen != list(range(workers)) or any(not group for group in self.groups):
            raise ValueError(f"barrier groups {self.groups} must partition the {workers} workers")
        if self.models is not None and len(self.models) != workers:
            raise ValueError(f"{len(self.models)} step models for {workers} workers")

    @property
    def shared(self) -> bool:
        """True when one barrier spans every worker."""
        return len(self.groups) == 1


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """G decode workers with B slots each, stepping under T = a·max L + b (`clock`: barrier groups
    and per-worker models instead; None is one barrier over all workers with `step`); `limits`: the
    engine's token budget and KV cache (None: the paper's model, B slots only)."""

    workers: int = 8
    slots: int = 64
    step: StepTimeModel = field(default_factory=StepTimeModel)
    prefill: PrefillConfig | None = None
    br: BRParams = field(default_factory=BRParams)
    bra: BRAParams = field(default_factory=BRAParams)  # BRA (this project's policy) only
    refresh_steps: int = 16
    seed: int = 0
    trajectory_points: int = 0  # >0: keep about this many per-step load samples for plots
    clock: LaneClock | None = None
    limits: EngineLimits | None = None

    def __post_init__(self) -> None:
        if self.clock is not None:
            self.clock.check(self.workers)
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if self.slots < 1:
            raise ValueError(f"slots must be >= 1, got {self.slots}")
        if self.refresh_steps < 1:
            raise ValueError(f"refresh_steps must be >= 1, got {self.refresh_steps}")


@dataclass(frozen=True, slots=True)
class LaneSpec:
    """One lane: a policy (and for BR-H a predictor). `forced` replays given assignments.
    `view_age_s`: the age of the lane's view of the engines at most (None: its policy's default,
    `Policy.view_age_s`; `shadow.core.routers.StaleView`)."""

    policy: str
    predictor: str | None = None
    name: str = ""
    view_age_s: float | None = None

    def __post_init__(self) -> None:
        p = lookup(self.policy)
        if p is None:
            raise ValueError(f"unknown policy {self.policy!r}; known: {list(REGISTRY)}")
        object.__setattr__(self, "policy", p.name)  # an alias names its policy
        if p.predicted:
            if self.predictor not in PREDICTORS:
                raise ValueError(
                    f"{self.policy} needs a predictor, one of {list(PREDICTORS)}; got {self.predictor!r}"
                )
        elif self.predictor is not None:
            raise ValueError(f"policy {self.policy!r} takes no predictor")

    @property
    def label(self) -> str:
        """Display name: e.g. "brh-survival"; the oracle lane is marked as an offline bound."""
        if self.name:
            return self.name
        base = f"{self.policy}-{self.predictor}" if self.predictor is not None else self.policy
        return base if self.view_age_s is None else f"{base}@{format_age(self.view_age_s)}"

    @classmethod
    def parse(cls, text: str) -> LaneSpec:
        """ "jsq", "br0", "brh" (= brh:survival), "brh:oracle", "brh:exactmatch"; "bra" likewise;
        any of them with "@AGE" ("vllm-dp@10ms", "br0@100ms"; `parse_age`): its view's age."""
        head, at, age = text.strip().partition("@")
        view_age_s = parse_age(age) if at else None
        policy, _, predictor = head.partition(":")
        p = lookup(policy)
        if p is not None and p.predicted:
            return cls(policy, predictor or "survival", view_age_s=view_age_s)
        if predictor:
            raise ValueError(f"policy {policy!r} takes no predictor (got {text!r})")
        return cls(policy, view_age_s=view_age_s)

"""Configuration of the simulated fleet: sizes, ports, timing model and limits (validated, immutable).

All durations are *model* seconds unless stated otherwise; the fleet multiplies them by
`time_scale` to get wall-clock seconds (time_scale 0.1 runs ten times faster than the model).
Metrics and TTLs are wall-clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from shadow.core.stepmodel import DEFAULT_A_S_PER_TOKEN, DEFAULT_B_S, StepTimeModel
from shadow.fleet.faults import FaultSpec

DEFAULT_BASE_PORT = 18000
DECODE_PORT_OFFSET = 100  # decode rank g listens on BASE + 100 + g
DP_FRONT_PORT_OFFSET = 200  # the optional all-ranks port listens on BASE + 200
DEFAULT_MODEL = "sim-llm"
VLLM_VERSION = "0.33.0"


@dataclass(frozen=True, slots=True)
class FleetConfig:
    """Everything needed to start a fleet; `base_port=0` means "pick free ports"."""

    prefill: int = 1
    decode: int = 2
    slots: int = 64
    host: str = "127.0.0.1"
    base_port: int = DEFAULT_BASE_PORT
    time_scale: float = 1.0
    a: float = DEFAULT_A_S_PER_TOKEN
    b: float = DEFAULT_B_S
    prefill_c0: float = 0.010  # model seconds per prefill
    prefill_c1: float = 2.0e-5  # model seconds per prompt token
    model: str = DEFAULT_MODEL
    max_model_len: int = 32768
    kv_capacity_tokens: int = 1 << 20  # per engine
    block_size: int = 16
    max_num_batched_tokens: int | None = None  # a decode step's token budget (None: no budget)
    kv_ttl_s: float = 480.0  # wall seconds a prefill holds unclaimed KV (VLLM_NIXL_ABORT_REQUEST_TIMEOUT)
    catch_up_s: float = 0.0  # lateness (s) the decode clock makes up to keep the model's timeline
    mean_output_tokens: int = 128  # mean of the deterministic output-length draw (no ignore_eos)
    max_body_bytes: int = 8 << 20
    dp_front: bool = False  # also serve all decode ranks on one port (X-data-parallel-rank)
    faults: tuple[FaultSpec, ...] = field(default_factory=tuple)
    # Bearer token for POST /fleet/faults. Without one, fault injection is accepted only when the
    # fleet listens on loopback.
    control_token: str | None = None

    def __post_init__(self) -> None:
        if self.prefill < 0 or self.decode < 1:
            raise ValueError("fleet: need prefill >= 0 and decode >= 1")
        if self.slots < 1:
            raise ValueError("fleet: slots must be >= 1")
        if not (math.isfinite(self.time_scale) and self.time_scale > 0):
            raise ValueError("fleet: time_scale must be a finite number > 0")
        if not (0 <= self.base_port <= 65535 - DP_FRONT_PORT_OFFSET):
            raise ValueError("fleet: base_port out of range")
        if self.base_port and max(self.prefill, 1) > DECODE_PORT_OFFSET:
            raise ValueError("fleet: at most 100 prefill servers with a fixed base port")
        if self.base_port and self.decode > DP_FRONT_PORT_OFFSET - DECODE_PORT_OFFSET:
            raise ValueError("fleet: at most 100 decode ranks with a fixed base port")
        for name in ("prefill_c0", "prefill_c1", "kv_ttl_s", "catch_up_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"fleet: {name} must be a finite number >= 0")
        for name in (
            "max_model_len",
            "kv_capacity_tokens",
            "block_size",
            "mean_output_tokens",
            "max_body_bytes",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"fleet: {name} must be >= 1")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < self.slots:
            raise ValueError("fleet: max_num_batched_tokens must be >= slots (vLLM's rule)")
        StepTimeModel(self.a, self.b)  # validates a, b
        for spec in self.faults:
            size = self.prefill if spec.target.role == "prefill" else self.decode
            if spec.target.index is not None and spec.target.index >= size:
                have = f"{spec.target.role}/0..{size - 1}" if size else f"no {spec.target.role} servers"
                raise ValueError(f"fleet: fault target {spec.target} does not exist ({have})")

    @property
    def step_model(self) -> StepTimeModel:
        return StepTimeModel(self.a, self.b)

    def prefill_port(self, i: int) -> int:
        return self.base_port + i if self.base_port else 0

    def decode_port(self, g: int) -> int:
        return self.base_port + DECODE_PORT_OFFSET + g if self.base_port else 0

    def dp_front_port(self) -> int:
        return self.base_port + DP_FRONT_PORT_OFFSET if self.base_port else 0

"""Configuration of the simulated fleet: sizes, ports, timing model and limits (validated, immutable).

All durations are *model* seconds unless stated otherwise; the fleet multiplies them by
`time_scale` to get wall-clock seconds (time_scale 0.1 runs ten times faster than the model).
Metrics and TTLs are wall-clock.

Each setting of `shadow fleet` is declared once, as a field here (`shadow.base.knobs`): its flag,
type, default, help and bound; the command derives its flags from them, and a value out of its
bound is a ValueError naming the flag. Checks across fields stay in `__post_init__`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shadow.base.knobs import AT_LEAST_ONE, NON_NEGATIVE, NON_NEGATIVE_S, POSITIVE, Bound, check_knobs, knob
from shadow.core.stepmodel import DEFAULT_A_S_PER_TOKEN, DEFAULT_B_S, StepTimeModel
from shadow.fleet.faults import FaultSpec

DEFAULT_BASE_PORT = 18000
DECODE_PORT_OFFSET = 100  # decode rank g listens on BASE + 100 + g
DP_FRONT_PORT_OFFSET = 200  # the optional all-ranks port listens on BASE + 200
DEFAULT_MODEL = "sim-llm"
VLLM_VERSION = "0.33.0"

#: The base port: every port of the fleet (up to BASE + 200) must be a port.
BASE_PORT = Bound(lambda v: 0 <= v <= 65535 - DP_FRONT_PORT_OFFSET,
                  f"a port in 0..{65535 - DP_FRONT_PORT_OFFSET} (0 = free ports)")


@dataclass(frozen=True, slots=True)
class FleetConfig:
    """Everything needed to start a fleet; `base_port=0` means "pick free ports".

    `--prefill` and `--port` are None on the command line when not given (`unset_is_none`): the
    simulated fleet then takes these fields' defaults, `--engine vllm` its own (0; free ports)."""

    prefill: int = knob(1, "--prefill", "prefill servers; 0 with --engine vllm unless given", NON_NEGATIVE,
                        metavar="N", unset_is_none=True)
    decode: int = knob(2, "--decode", "decode DP ranks", AT_LEAST_ONE, metavar="G")
    slots: int = knob(64, "--slots", "running slots per rank", AT_LEAST_ONE, metavar="B")
    host: str = knob("127.0.0.1", "--host", "bind address")
    # Bearer token for POST /fleet/faults. Without one, fault injection is accepted only when the
    # fleet listens on loopback. (`shadow fleet` reads SHADOW_FLEET_CONTROL_TOKEN when not given.)
    control_token: str | None = knob(
        None, "--control-token", "bearer token for POST /fleet/faults, else env SHADOW_FLEET_CONTROL_TOKEN; "
        "without one, fault injection is refused unless the fleet listens on loopback")
    base_port: int = knob(DEFAULT_BASE_PORT, "--port",
                          "base port (0 = free ports; --engine vllm: free ports unless given)", BASE_PORT,
                          metavar="BASE", unset_is_none=True)
    time_scale: float = knob(1.0, "--time-scale", "wall seconds per model second; 0.1 runs 10× faster",
                             POSITIVE, metavar="X")
    a: float = knob(DEFAULT_A_S_PER_TOKEN, "--a", "step seconds per KV token of max load", NON_NEGATIVE_S)
    b: float = knob(DEFAULT_B_S, "--b", "fixed step seconds", NON_NEGATIVE_S)
    prefill_c0: float = knob(0.010, "--prefill-c0", "prefill seconds per request", NON_NEGATIVE_S)
    prefill_c1: float = knob(2.0e-5, "--prefill-c1", "prefill seconds per prompt token", NON_NEGATIVE_S)
    model: str = knob(DEFAULT_MODEL, "--model", "served model name")
    max_model_len: int = knob(32768, "--max-model-len", "context length in tokens (prompt + output)",
                              AT_LEAST_ONE)
    kv_capacity_tokens: int = knob(1 << 20, "--kv-tokens", "KV capacity per engine, in tokens", AT_LEAST_ONE)
    block_size: int = 16
    max_num_batched_tokens: int | None = None  # a decode step's token budget (None: no budget)
    # wall seconds a prefill holds unclaimed KV (VLLM_NIXL_ABORT_REQUEST_TIMEOUT)
    kv_ttl_s: float = knob(480.0, "--kv-ttl", "seconds a prefill holds KV nobody pulled", NON_NEGATIVE_S)
    # lateness (s) the decode clock makes up to keep the model's timeline
    catch_up_s: float = knob(
        0.0, "--catch-up", "keep the step model's timeline on a busy host: make up to S seconds of lateness "
        "(held-up steps end at once; 0: only a lateness shorter than the step)", NON_NEGATIVE_S, metavar="S")
    mean_output_tokens: int = knob(128, "--mean-output-tokens",
                                   "mean output length of requests without ignore_eos (deterministic draw)",
                                   AT_LEAST_ONE)
    max_body_bytes: int = knob(8 << 20, "--max-body-bytes", "request body limit (413 above)", AT_LEAST_ONE)
    dp_front: bool = knob(False, "--dp-front",
                          "also serve all decode ranks on PORT+200, chosen by X-data-parallel-rank")
    faults: tuple[FaultSpec, ...] = field(default_factory=tuple)  # `--fault`, repeatable (shadow fleet)

    def __post_init__(self) -> None:
        check_knobs(self)  # every setting within its bound, naming its flag
        if self.base_port and max(self.prefill, 1) > DECODE_PORT_OFFSET:
            raise ValueError(f"--prefill must be <= {DECODE_PORT_OFFSET} with a fixed --port "
                             f"(0: free ports), got {self.prefill}")
        if self.base_port and self.decode > DP_FRONT_PORT_OFFSET - DECODE_PORT_OFFSET:
            raise ValueError(f"--decode must be <= {DP_FRONT_PORT_OFFSET - DECODE_PORT_OFFSET} with a fixed "
                             f"--port (0: free ports), got {self.decode}")
        if self.block_size < 1:
            raise ValueError("fleet: block_size must be >= 1")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < self.slots:
            raise ValueError("fleet: max_num_batched_tokens must be >= slots (vLLM's rule)")
        if self.a == 0 and self.b == 0:
            raise ValueError("--a and --b cannot both be 0 (steps would take no time)")
        StepTimeModel(self.a, self.b)  # validates a, b
        for spec in self.faults:
            size = self.prefill if spec.target.role == "prefill" else self.decode
            if spec.target.index is not None and spec.target.index >= size:
                have = f"{spec.target.role}/0..{size - 1}" if size else f"no {spec.target.role} servers"
                raise ValueError(f"--fault target {spec.target} does not exist ({have})")

    @property
    def step_model(self) -> StepTimeModel:
        return StepTimeModel(self.a, self.b)

    def prefill_port(self, i: int) -> int:
        return self.base_port + i if self.base_port else 0

    def decode_port(self, g: int) -> int:
        return self.base_port + DECODE_PORT_OFFSET + g if self.base_port else 0

    def dp_front_port(self) -> int:
        return self.base_port + DP_FRONT_PORT_OFFSET if self.base_port else 0

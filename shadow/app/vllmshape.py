"""Which real-vLLM fleet `shadow demo --fleet vllm` runs: the MoE DP pair (one API server per DP
rank, the ranks stepping in lockstep: a real barrier) or independent servers of the tiny model
(no barrier between them).

The rule (`choose_vllm_fleet`, pure: the machine comes in as arguments): the MoE pair when

- the cores this process may run on number at least `MOE_RANKS + SPARE_CORES`: one core per
  rank, because both ranks busy their core while either has work (an idle rank steps dummy
  batches with its partner), plus `SPARE_CORES` for the sidecar, the router and the load
  generator, which otherwise wait for a CPU behind the ranks and stretch every step; and
- the 1-minute load average leaves the ranks their cores: `cores - load1 >= MOE_RANKS`;
- and the demo was asked for `MOE_RANKS` decode workers (the pair has that many).

Otherwise the independent servers, with one line saying which condition failed. `--vllm-fleet
moe-dp` or `independent` forces either (`FORCED`); `auto` applies the rule.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

MOE_RANKS = 2  # the MoE DP pair: --data-parallel-size 2, one API server (decode worker) per rank
SPARE_CORES = 1  # beyond the ranks' cores: the sidecar, the router and the load generator
SHAPES = ("auto", "moe-dp", "independent")  # --vllm-fleet
MOE_MODEL = "moe"  # the built-in model the pair serves (tiny Mixtral: 4 experts, top-2)


@dataclass(frozen=True, slots=True)
class FleetChoice:
    """The fleet to start and, in one clause, why."""

    moe_dp: bool
    reason: str
    forced: bool = False

    @property
    def shape(self) -> str:
        return "moe-dp" if self.moe_dp else "independent"

    def line(self) -> str:
        """The one line the demo prints about it."""
        if self.moe_dp:
            return (f"fleet: the MoE DP pair ({MOE_RANKS} ranks of the {MOE_MODEL} model in lockstep, one "
                    f"API server each): {self.reason}")
        return f"fleet: independent servers, not the MoE DP pair: {self.reason}"


def choose_vllm_fleet(cores: int, load1: float, workers: int, force: str = "auto") -> FleetChoice:
    """The fleet for `cores` usable cores, a 1-minute load average `load1` and `workers` decode
    workers asked for, unless `force` (one of SHAPES) says which (see the module docstring)."""
    if force not in SHAPES:
        raise ValueError(f"--vllm-fleet must be one of {', '.join(SHAPES)}, got {force!r}")
    if force == "moe-dp":
        if workers != MOE_RANKS:
            raise ValueError(f"--vllm-fleet moe-dp runs {MOE_RANKS} ranks: -G {workers} does not fit")
        return FleetChoice(True, "forced by --vllm-fleet moe-dp", forced=True)
    if force == "independent":
        return FleetChoice(False, "forced by --vllm-fleet independent", forced=True)
    need = MOE_RANKS + SPARE_CORES
    hint = " (--vllm-fleet moe-dp forces it)"
    if workers != MOE_RANKS:
        return FleetChoice(False, f"-G {workers} asked for, the pair has {MOE_RANKS} ranks{hint}")
    if cores < need:
        return FleetChoice(False, f"{cores} usable cores, the pair needs {need} (one per rank, both busy "
                           f"while either has work, + {SPARE_CORES} for the sidecar, router and load)"
                           f"{hint}")
    if cores - load1 < MOE_RANKS:
        return FleetChoice(False, f"load average {load1:.2f} on {cores} cores leaves {cores - load1:.2f} "
                           f"free, the ranks need {MOE_RANKS}{hint}")
    return FleetChoice(True, f"{cores} usable cores, load average {load1:.2f} (rule: cores >= {need} "
                       f"and cores - load >= {MOE_RANKS})")


def machine() -> tuple[int, float]:
    """This machine as the rule reads it: the cores this process may run on, the 1-minute load
    average."""
    return len(os.sched_getaffinity(0)), os.getloadavg()[0]

"""`shadow demo --fleet vllm` picks the MoE DP pair or independent servers by a stated rule
(`shadow.app.vllmshape`): enough usable cores for the ranks and the sidecar, the ranks' cores free
by the load average, two workers asked for; a flag forces either; the demo's options and command
line carry the choice."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shadow.app.demo import DemoOptions
from shadow.app.vllmshape import MOE_RANKS, SPARE_CORES, choose_vllm_fleet
from shadow.commands import demo as demo_command
from shadow.commands._help import ShadowArgumentParser

NEED = MOE_RANKS + SPARE_CORES


def test_a_quiet_machine_with_the_cores_runs_the_pair() -> None:
    c = choose_vllm_fleet(cores=NEED, load1=0.5, workers=MOE_RANKS)
    assert c.moe_dp and not c.forced and c.shape == "moe-dp"
    assert c.line().startswith("fleet: the MoE DP pair")


def test_too_few_cores_falls_back_and_says_so() -> None:
    c = choose_vllm_fleet(cores=2, load1=0.0, workers=MOE_RANKS)
    assert not c.moe_dp and c.shape == "independent"
    assert c.line() == ("fleet: independent servers, not the MoE DP pair: 2 usable cores, the pair needs "
                        f"{NEED} (one per rank, both busy while either has work, + {SPARE_CORES} for the "
                        "sidecar, router and load) (--vllm-fleet moe-dp forces it)")


def test_a_loaded_machine_falls_back_and_gives_its_load() -> None:
    c = choose_vllm_fleet(cores=4, load1=2.5, workers=MOE_RANKS)
    assert not c.moe_dp and "load average 2.50 on 4 cores leaves 1.50 free" in c.reason


def test_other_worker_counts_fall_back() -> None:
    c = choose_vllm_fleet(cores=64, load1=0.0, workers=4)
    assert not c.moe_dp and "-G 4" in c.reason


def test_the_flag_forces_either_way() -> None:
    assert choose_vllm_fleet(cores=1, load1=30.0, workers=MOE_RANKS, force="moe-dp").moe_dp
    c = choose_vllm_fleet(cores=64, load1=0.0, workers=MOE_RANKS, force="independent")
    assert not c.moe_dp and c.forced and "forced" in c.line()
    with pytest.raises(ValueError, match="-G 3"):
        choose_vllm_fleet(cores=64, load1=0.0, workers=3, force="moe-dp")
    with pytest.raises(ValueError, match="--vllm-fleet"):
        choose_vllm_fleet(cores=64, load1=0.0, workers=2, force="maybe")


@given(cores=st.integers(1, 256), load1=st.floats(0.0, 300.0), workers=st.integers(1, 16))
def test_the_rule_is_the_stated_one(cores: int, load1: float, workers: int) -> None:
    c = choose_vllm_fleet(cores, load1, workers)
    assert c.moe_dp == (workers == MOE_RANKS and cores >= NEED and cores - load1 >= MOE_RANKS)
    assert not c.forced and c.reason
    if not c.moe_dp:
        assert "--vllm-fleet moe-dp forces it" in c.reason


@given(load1=st.floats(0.0, 300.0), more=st.floats(0.0, 50.0))
def test_more_load_never_turns_the_pair_on(load1: float, more: float) -> None:
    if not choose_vllm_fleet(8, load1, MOE_RANKS).moe_dp:
        assert not choose_vllm_fleet(8, load1 + more, MOE_RANKS).moe_dp


def test_the_demo_command_carries_the_flag_and_checks_it() -> None:
    parser = ShadowArgumentParser()
    demo_command.register(parser.add_subparsers())
    args = parser.parse_args(["demo", "--fleet", "vllm", "--vllm-fleet", "moe-dp"])
    assert args.vllm_fleet == "moe-dp"
    assert parser.parse_args(["demo"]).vllm_fleet == "auto"
    with pytest.raises(ValueError, match="-G 4"):
        DemoOptions(fleet="vllm", workers=4, vllm_fleet="moe-dp").validate()
    with pytest.raises(ValueError, match="--vllm-fleet"):
        DemoOptions(vllm_fleet="pair").validate()
    DemoOptions(fleet="vllm", workers=2, vllm_fleet="moe-dp").validate()


def test_the_sidecars_port_and_its_taps_ports_are_held_until_it_starts() -> None:
    """`shadow demo --fleet vllm` picks serve's API port before the engines start (their probes post
    there) and serve's taps take the following ports: all of them stay bound until serve starts, so
    that an engine's own sockets cannot take one (a CI run lost the MoE demo to a tap port taken)."""
    import socket

    from shadow.app.demo import _reserve_ports

    held = _reserve_ports(3)
    try:
        ports = [s.getsockname()[1] for s in held]
        assert ports == [ports[0], ports[0] + 1, ports[0] + 2]
        for port in ports:
            with socket.socket() as other, pytest.raises(OSError):
                other.bind(("127.0.0.1", port))
    finally:
        for s in held:
            s.close()
    for port in ports:  # released: serve can bind them
        with socket.socket() as again:
            again.bind(("127.0.0.1", port))

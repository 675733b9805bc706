"""How the suite is shared out on several workers (tests/conftest.py) stays true of the tree: the
host-bound modules it names exist, every module that starts CPU burners is one of them, and the
real-engine tier's server-stopping test is the last of its unit."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import HOST_BOUND, TIER, _rank, _unit

ROOT = Path(__file__).resolve().parent.parent


def test_every_host_bound_module_exists() -> None:
    missing = [m for m in HOST_BOUND if not (ROOT / m).is_file()]
    assert not missing, f"HOST_BOUND names modules that are gone: {missing}"


def test_every_module_that_starts_cpu_burners_is_host_bound() -> None:
    burning = sorted(
        str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
        if re.search(r"\bcpu_burners\b", p.read_text())
    )
    assert burning, "no module starts CPU burners: this check no longer checks anything"
    assert set(burning) <= set(HOST_BOUND), f"add to HOST_BOUND: {sorted(set(burning) - set(HOST_BOUND))}"


def test_units_and_their_order() -> None:
    assert _unit(TIER + "test_units.py::test_x") == _unit(TIER + "test_probe.py::test_y") == TIER
    assert _unit(HOST_BOUND[0] + "::a") == _unit(HOST_BOUND[-1] + "::b") == "host-bound"
    assert _unit("tests/core/test_stats.py::test_z[1]") == "tests/core/test_stats.py"
    integration = {"host-bound", TIER, "tests/live/test_x.py"}
    units = ("host-bound", "tests/core/test_stats.py", "tests/live/test_x.py", TIER)
    ranks = [_rank(u, integration) for u in units]
    assert ranks == sorted(ranks) and len(set(ranks)) == 4


def test_the_tier_stopping_test_is_last_of_its_unit(request: pytest.FixtureRequest) -> None:
    items = request.session.items
    tier = [i for i in items if _unit(i.nodeid) == TIER]
    if not tier:
        pytest.skip("this run collected no test of the real-engine tier (the whole suite does)")
    stoppers = [n for n, i in enumerate(tier) if i.get_closest_marker("stops_tier")]
    assert stoppers and stoppers == list(range(len(tier) - len(stoppers), len(tier))), stoppers

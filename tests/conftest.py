"""Hypothesis profiles for the whole suite, chosen by the SHADOW_HYPOTHESIS_PROFILE variable, a
state directory of its own for every test, and the units the suite is shared out in when it runs
on several workers (pytest-xdist, `-n N`, as scripts/test.sh runs it).

`default`: each test's own settings (the normal suite). `mutation` (set by scripts/mutation.sh):
every property test runs at most SHADOW_MUTATION_MAX_EXAMPLES examples (default 30, also capping
tests that set a larger `max_examples` themselves), derandomized and without the example
database, so a mutant's verdict does not depend on luck or on what an earlier mutant's run saved;
and without shrinking: the first failing example kills the mutant (shrinking only makes a failure
already found smaller, and re-runs the test hundreds of times doing so).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import Phase, settings

from tests.harness import stop_tap_groups

PROFILE_VAR = "SHADOW_HYPOTHESIS_PROFILE"
MUTATION = "mutation"

settings.register_profile(
    MUTATION,
    max_examples=int(os.environ.get("SHADOW_MUTATION_MAX_EXAMPLES", "30")),
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=False,
    phases=(Phase.explicit, Phase.generate),
)
_profile = os.environ.get(PROFILE_VAR, "default")
settings.load_profile(_profile)


TIER = "tests/realvllm/"
#: Modules that load the host on purpose (4 CPU burners, an image build) or whose claim needs the
#: host to keep the simulated fleet's real-time steps (saturation): with several workers they run
#: one after another in one unit, first, so never beside each other and before the real-engine tier
#: is started (beside the burners and the tier's start, a saturation run fell to 76 % occupancy).
HOST_BOUND = (
    "tests/active/test_active_e2e.py",
    "tests/active/test_canary_analysis.py",
    "tests/active/test_fallback_under_load.py",
    "tests/deploy/test_image.py",
)


def _unit(nodeid: str) -> str:
    """The unit of work a test belongs to when the suite runs on several workers: its module, the
    real-engine tier as one, or the host-bound modules as one."""
    module = nodeid.split("::", 1)[0]
    if module.startswith(TIER):
        return TIER
    return "host-bound" if module in HOST_BOUND else module


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Order the suite for several workers (see `_rank`); under the mutation profile, cap the
    example counts."""
    integration = {_unit(i.nodeid) for i in items if i.get_closest_marker("integration")}
    items.sort(key=lambda i: _rank(_unit(i.nodeid), integration))  # stable: order inside a unit kept
    if _profile == MUTATION:
        _cap_examples(items)


def _rank(unit: str, integration: set[str]) -> int:
    """Units go out to workers in this order: the host-bound unit (the longest but one), the modules
    that start no process of their own, the other integration modules, and last the real-engine
    tier. The tier's vLLM servers keep both cores busy with threads bound to them (their start is
    minutes of CPU and disk): beside them a process of another test took 50 s to start, so the tier
    goes when little else is left, as it does in a serial run."""
    if unit == "host-bound":
        return 0
    if unit not in integration:
        return 1
    return 3 if unit == TIER else 2


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """How pytest-xdist shares the suite out (`-n N`, as scripts/test.sh runs it): whole units
    (`_unit`), in the collection's order (`_rank`)."""
    from xdist.scheduler import LoadScopeScheduling

    class WholeUnits(LoadScopeScheduling):
        """One unit of work per test module, so a module's fixtures start once, on one worker; the
        real-engine tier as one unit, whose tests share the vLLM servers a session fixture starts
        (each worker would start its own) and end with the one that stops a server; the host-bound
        modules as one. Units go out in collection order (xdist's default sorts them by size)."""

        def _split_scope(self, nodeid: str) -> str:
            return _unit(nodeid)

        def _reschedule(self, node: Any) -> None:
            # The tier, last, goes to the first worker down to its last test (a worker runs a test
            # once it holds the next one or is told to stop, so it never gets to none): queued
            # behind a long test it would start minutes after the other workers went idle.
            tier_next = bool(self.workqueue) and next(iter(self.workqueue)) == TIER
            if tier_next and self._pending_of(self.assigned_work[node]) > 1:
                return
            super()._reschedule(node)

    config.option.loadscopereorder = False
    return WholeUnits(config, log)


def _cap_examples(items: list[pytest.Item]) -> None:
    """Under the mutation profile, cap the tests that set their own (larger) example count."""
    cap = settings.get_profile(MUTATION)
    for item in items:
        fn = getattr(item, "obj", None)
        own = getattr(fn, "_hypothesis_internal_use_settings", None)
        if own is not None:
            fn._hypothesis_internal_use_settings = settings(  # type: ignore[union-attr]
                own,
                max_examples=min(own.max_examples, cap.max_examples),
                derandomize=True,
                database=None,
                phases=cap.phases,
            )


@pytest.fixture(autouse=True)
def state_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Every test's processes keep their state (tap groups, the prompt-key secret) in a directory
    of their own (SHADOW_STATE_DIR); the tap groups still running there afterwards are stopped
    (`shadow serve` leaves the groups it started serving on purpose: they outlive it)."""
    d = tmp_path_factory.mktemp("state")
    monkeypatch.setenv("SHADOW_STATE_DIR", str(d))
    yield d
    stop_tap_groups(d)

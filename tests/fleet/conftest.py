"""Fixtures for the simulated-fleet tests: fleets on free ports, small time scales."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from shadow.fleet import FleetConfig
from tests.harness import FleetThread

# Fast steps: b = 20 ms × 0.25 = 5 ms per step when lightly loaded.
FAST = {"base_port": 0, "time_scale": 0.25, "prefill_c0": 0.004}


@pytest.fixture
def fleet() -> Iterator[FleetThread]:
    """1 prefill + 2 decode ranks on free ports."""
    with FleetThread(FleetConfig(prefill=1, decode=2, **FAST)) as ft:  # type: ignore[arg-type]
        yield ft

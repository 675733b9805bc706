"""Hypothesis profiles for the whole suite, chosen by the SHADOW_HYPOTHESIS_PROFILE variable, and
a state directory of its own for every test.

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


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under the mutation profile, cap the tests that set their own (larger) example count."""
    if _profile != MUTATION:
        return
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

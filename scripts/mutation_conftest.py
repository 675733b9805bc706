"""Root conftest used only inside the scratch copies made by scripts/mutation.sh.

Caps every Hypothesis test at MUTATION_MAX_EXAMPLES examples (default 30) so that the test run
of a surviving mutant (which runs every covering test to the end) stays short. The normal
suite keeps each test's own example count; the kill rate is measured under this cap.
"""

from __future__ import annotations

import os

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    from hypothesis import settings

    cap = int(os.environ.get("MUTATION_MAX_EXAMPLES", "30"))
    for item in items:
        fn = getattr(item, "obj", None)
        current = getattr(fn, "_hypothesis_internal_use_settings", None)
        if current is not None and current.max_examples > cap:
            fn._hypothesis_internal_use_settings = settings(current, max_examples=cap)  # type: ignore[union-attr]

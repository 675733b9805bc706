"""How the commands that run a server fail: one line on stderr, exit 2 or 1."""

from __future__ import annotations

import sys
from collections.abc import Callable


def run_reporting(prog: str, body: Callable[[], None]) -> int:
    """Run a service's `body`; bad configuration exits 2, OS errors (ports, files) 1, one line each."""
    try:
        body()
    except ValueError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1
    return 0

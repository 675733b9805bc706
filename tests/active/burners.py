"""CPU burners for tests that must hold on a loaded host: `cpu_burners(n)` runs n processes that
each spin a core (`python -c "while True: pass"`) for the whole block and always kills them."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def cpu_burners(n: int) -> Iterator[list[subprocess.Popen[bytes]]]:
    """n busy-looping processes until the block ends (killed and reaped however it ends)."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(n):
            procs.append(subprocess.Popen([sys.executable, "-c", "while True: pass"],
                                          stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL))
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait(10)

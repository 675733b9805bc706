"""Start `shadow` sub-commands as real processes and read their JSON ready line."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from shadow.base.procs import read_json_line, shadow_argv


@contextmanager
def shadow_process(
    args: Sequence[str], timeout: float = 60.0, nofile: int | None = None
) -> Iterator[tuple[subprocess.Popen[str], dict[str, Any]]]:
    """`python -m shadow ARGS` until the block ends (SIGINT, then kill); yields (proc, ready doc).
    `nofile`: the process's open-files limit (soft and hard)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")

    def limit() -> None:
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    proc = subprocess.Popen(
        shadow_argv(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        preexec_fn=limit if nofile is not None else None,
    )
    try:
        try:
            ready = read_json_line(proc, " ".join(args[:1]), timeout)
        except RuntimeError as exc:  # say why: the process's own last words
            if proc.poll() is None:
                proc.kill()
            assert proc.stderr is not None
            raise RuntimeError(f"{exc}; its stderr ends: {proc.stderr.read()[-3000:]}") from None
        yield proc, ready
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        for f in (proc.stdout, proc.stderr):
            if f is not None:
                f.close()

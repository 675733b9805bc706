"""Progress display of a load run: a rich progress bar on a terminal, plain lines otherwise.

The runner reports through the small ``ProgressSink`` protocol, so tests and library users can
pass their own sink (or none).
"""

from __future__ import annotations

import sys
import time
from typing import Any, Protocol, TextIO


class ProgressSink(Protocol):
    """Receives progress of a run: ``start`` once, ``update`` after each request, ``close`` once."""

    def start(self, total: int) -> None: ...

    def update(self, done: int, failed: int, in_flight: int) -> None: ...

    def close(self) -> None: ...


class NullProgress:
    """Shows nothing."""

    def start(self, total: int) -> None:
        pass

    def update(self, done: int, failed: int, in_flight: int) -> None:
        pass

    def close(self) -> None:
        pass


class PlainProgress:
    """One line per 10% of the requests, and at least every ``every_s`` seconds, for logs and pipes."""

    def __init__(self, stream: TextIO | None = None, every_s: float = 10.0) -> None:
        self.stream = stream if stream is not None else sys.stdout
        self.every_s = every_s
        self._total = 0
        self._next_step = 0
        self._last_print = 0.0
        self._last: tuple[int, int, int] = (0, 0, 0)

    def start(self, total: int) -> None:
        self._total = total
        self._next_step = 1
        self._last_print = time.monotonic()
        print(f"load: sending {total} requests", file=self.stream, flush=True)

    def _print(self) -> None:
        done, failed, in_flight = self._last
        print(
            f"load: {done}/{self._total} done, {failed} failed, {in_flight} in flight",
            file=self.stream,
            flush=True,
        )
        self._last_print = time.monotonic()

    def update(self, done: int, failed: int, in_flight: int) -> None:
        self._last = (done, failed, in_flight)
        milestone = self._total > 0 and done * 10 >= self._next_step * self._total
        if milestone:
            while self._next_step * self._total <= done * 10:
                self._next_step += 1
        if milestone or time.monotonic() - self._last_print >= self.every_s:
            self._print()

    def close(self) -> None:
        pass


class RichProgress:
    """A live rich progress bar: requests done/total, failures, in flight, elapsed, remaining."""

    def __init__(self, console: Any) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self._progress = Progress(
            TextColumn("[bold]load"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("failed [red]{task.fields[failed]}[/]  in flight {task.fields[in_flight]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=console,
            transient=False,
        )
        self._task: Any = None

    def start(self, total: int) -> None:
        self._progress.start()
        self._task = self._progress.add_task("load", total=total, failed=0, in_flight=0)

    def update(self, done: int, failed: int, in_flight: int) -> None:
        self._progress.update(self._task, completed=done, failed=failed, in_flight=in_flight)

    def close(self) -> None:
        self._progress.stop()


def make_progress(console: Any, *, quiet: bool = False) -> ProgressSink:
    """A rich bar when ``console`` is a terminal, plain lines otherwise, nothing when ``quiet``."""
    if quiet:
        return NullProgress()
    if getattr(console, "is_terminal", False):
        return RichProgress(console)
    return PlainProgress(getattr(console, "file", None))

"""worker_down from scrapes that hold on a loaded host: a refused connection (nothing listens) is a
worker down at once; a connect timeout, which a loaded host can cause, only after two failed
scrapes in a row; a good scrape in between starts the count again."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from shadow.active.health import HealthReader
from shadow.mirror.reconcile import WorkerReconcile


def reader(**workers: WorkerReconcile) -> HealthReader:
    rec: Any = SimpleNamespace(workers=workers, scrapes=0, state=SimpleNamespace(workers={}))
    return HealthReader(rec)


def fail(w: WorkerReconcile, error: str) -> None:
    w.errors += 1
    w.last_error = error


def test_a_refused_connection_is_down_at_once_a_timeout_only_twice_in_a_row() -> None:
    d0, d1 = WorkerReconcile("http://d0"), WorkerReconcile("http://d1")
    r = reader(d0=d0, d1=d1)
    fail(d0, "ConnectError")
    fail(d1, "ConnectTimeout")
    for _ in range(3):  # read more often than scraped: the same failed scrape counts once
        assert r.read(1.0).unreachable == {"d0"}
    fail(d1, "ConnectTimeout")
    assert r.read(2.0).unreachable == {"d0", "d1"}
    d1.last_error = None  # a good scrape
    assert r.read(3.0).unreachable == {"d0"}
    fail(d1, "ConnectTimeout")
    assert r.read(4.0).unreachable == {"d0"}
    fail(d1, "ReadTimeout")  # answered, slowly: not unreachable, and the row is broken
    assert r.read(4.5).unreachable == {"d0"}
    fail(d1, "ConnectTimeout")
    assert r.read(5.0).unreachable == {"d0"}

"""`shadow sweep --ray`: the protocol's cells run as Ray tasks (the optional `ray` extra).

A thin adapter over `shadow.replay.protocol`: each task runs exactly the function the local
process pool runs (`_run_cell_timed`) on the same picklable `Cell`, so every figure is the one a
local run gives (decision times are wall-clock measurements and differ, as between two local
runs). Results come back in the order of the cells; progress is reported as each cell finishes.
Ray is imported only here and only when asked for; every way it can fail to start is one line.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any
from urllib.parse import urlsplit

from shadow.replay.protocol import Cell, _run_cell_timed
from shadow.traces.synthetic import SYNTHETIC_SUFFIX, WORKLOADS

INSTALL_HINT = "pip install 'shadow[ray]'"
CONNECT_TIMEOUT_S = 5.0


class RayUnavailable(RuntimeError):
    """Ray is not installed, the address cannot be reached, or a cell failed on the cluster."""


def run_cells_ray(
    cells: Sequence[Cell],
    address: str | None,
    on_done: Callable[[dict[str, Any]], None] | None = None,
    on_connect: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Run `cells` as Ray tasks (one CPU each) and return their results in the order of `cells`.

    `address` is Ray's: None follows Ray's own lookup (RAY_ADDRESS, then the cluster `ray start`
    left on this machine, else a new local instance), or "auto", "local", HOST:PORT,
    ray://HOST:PORT. A process that already called `ray.init` keeps its session (not shut down).
    """
    ray = import_ray()
    cells = [portable(c) for c in cells]
    owned = not ray.is_initialized()
    if owned:
        connect(ray, address)
    pending: list[Any] = []
    try:
        if on_connect is not None:
            cpus = int(ray.cluster_resources().get("CPU", 0))
            on_connect(f"{len(cells)} cells as Ray tasks on {cpus} CPUs ({address or 'default address'})")
        task = ray.remote(num_cpus=1)(_run_cell_timed)
        refs = [task.remote(c) for c in cells]
        slot = {ref: i for i, ref in enumerate(refs)}
        out: list[dict[str, Any]] = [{}] * len(cells)
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            for ref in done:
                i = slot[ref]
                try:
                    out[i] = ray.get(ref)
                except ray.exceptions.RayError as exc:
                    raise RayUnavailable(f"{describe(cells[i])} failed on Ray: {_cause(exc)}") from None
                if on_done is not None:
                    on_done(out[i])
        return out
    except BaseException:
        for ref in pending:
            ray.cancel(ref)  # stop the rest on a failed cell or Ctrl-C
        raise
    finally:
        if owned:
            ray.shutdown()


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise RayUnavailable(f"--ray needs Ray, which is not installed: {INSTALL_HINT}") from None
    return ray


def connect(ray: Any, address: str | None) -> None:
    """`ray.init` at `address`, after a quick TCP check of a HOST:PORT so a dead address fails fast."""
    if address is not None and address not in ("auto", "local"):
        host, port = parse_address(address)
        try:
            socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S).close()
        except OSError as exc:
            raise RayUnavailable(f"cannot reach Ray at {address}: {exc.strerror or exc}") from None
    # No usage reports from a sweep (the cluster's own setting wins where one is set).
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    try:
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
    except Exception as exc:  # Ray raises ConnectionError, RuntimeError, ValueError, ... here
        where = address or "the default address"
        hint = ""
        if address not in (None, "auto", "local") and os.environ.get("RAY_AUTH_MODE", "") != "token":
            hint = " (a cluster with token authentication needs RAY_AUTH_MODE=token and RAY_AUTH_TOKEN)"
        raise RayUnavailable(f"cannot connect to Ray at {where}: {_first_line(exc)}{hint}") from None


def parse_address(address: str) -> tuple[str, int]:
    """(host, port) of HOST:PORT, [V6]:PORT or ray://HOST:PORT; a clear error for anything else."""
    rest = address.removeprefix("ray://")
    try:
        parts = urlsplit("//" + rest)
        host, port = parts.hostname, parts.port
    except ValueError:
        host, port = None, None
    if not host or port is None or parts.path or parts.query:
        raise RayUnavailable(
            f"not a Ray address: {address!r} (expected HOST:PORT, ray://HOST:PORT, auto or local)"
        )
    return host, port


def portable(cell: Cell) -> Cell:
    """The cell with a trace file's path made absolute: Ray workers do not share our working dir.

    Every node must see the file at that path (shared storage), as it must have shadow installed.
    """
    name = cell.workload
    if name.removesuffix(SYNTHETIC_SUFFIX) in WORKLOADS or not os.path.exists(name):
        return cell
    return replace(cell, workload=os.path.abspath(name))


def describe(cell: Cell) -> str:
    return f"cell {cell.workload} G={cell.workers} ρ={cell.load:g} seed={cell.seed}"


def _cause(exc: BaseException) -> str:
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException):
        return f"{type(cause).__name__}: {_first_line(cause)}"
    return f"{type(exc).__name__}: {_first_line(exc)}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__

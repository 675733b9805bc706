"""Live lanes spread over processes, or over a Ray cluster: the policies' lanes in shards, one
report.

The lanes are independent given what moves them: the events in order, the observation points
between them that no event marks (where the input went quiet, and its end: `LiveLanes.observe`),
and the times the lanes were advanced to. `ShardedLanes` keeps one central `LiveLanes` with only the
`actual` lane (event folding, step windows and fit, fidelity, the twin check: everything of the
report that is not a policy's lane) and tees those moves (`LiveLanes.tee`) to `shards` shards, each
a `LiveLanes` over some of the policies (dealt round-robin) that replays them in the same order: a
shard's lanes go through exactly the steps they take in one process. `report()` sends what is
pending, takes each shard's lane entries and booked windows, and builds the one report: the
central one with every policy's lane, their recent windows and the comparison against `actual`
over the windows every lane has passed, as one process computes them.

What it costs: each shard folds every event again (its own `actual` lane and request table), and
the moves are pickled once per send for all shards; what it spreads is the policies' lanes —
their routing decisions and steps.

Runners: `LocalShards` (in this process: the reference), `ProcessShards` (one process each, a pipe
each) and `RayShards` (one Ray actor each; `shadow.app.serve.ray_shards(address)` connects as
`shadow sweep --ray` does).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import pickle
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any, Protocol

from shadow.contracts.report import LaneReport, Report
from shadow.engine.config import LaneSpec
from shadow.engine.windows import Windows, WindowTotals
from shadow.live.confidence import comparison
from shadow.live.lanes import RECENT_WINDOWS, LiveLanes, window_fields
from shadow.live.routerrule import router_rule

#: the live driver's counts summed over its lanes (in the report's `rolling` block)
PER_LANE_COUNTERS = ("reseeds", "seed_unknown_worker")
Move = tuple[str, Any]  # ("batch", [events]) | ("observe", next point) | ("advance", t) | ("drain", None)
Part = dict[str, Any]  # a shard's lanes: {"lanes": {label: entry}, "windows": {label: (windows, passed)}}


class LaneShard:
    """One shard: a `LiveLanes` over some policies that replays the central one's moves."""

    def __init__(self, settings: dict[str, Any]) -> None:
        self.live = LiveLanes(**settings)

    def run(self, moves: Sequence[Move]) -> None:
        live = self.live
        for kind, arg in moves:
            if kind == "batch":
                live._queue.extend(arg)
                live.enqueued += len(arg)
                live.process_now()
            elif kind == "observe":
                live.observe(arg)
            elif kind == "advance":
                live.driver.advance_to(arg)
            elif kind == "drain":
                live.driver.drain()
            else:
                raise ValueError(f"unknown move {kind!r}")

    def part(self) -> Part:
        live = self.live
        live._publish()
        lanes = live.report()["lanes"]
        labels = [s.label for s in live.specs]
        d = live.driver
        return {"lanes": {label: lanes[label] for label in labels},
                "windows": {label: live.windows.booked(label) for label in labels},
                "counters": {name: getattr(d, name) for name in PER_LANE_COUNTERS},
                "open": d.open_requests()}


class Shards(Protocol):
    """Where the shards run: `send` hands every shard the same moves (in order), `parts` returns
    each shard's lanes once it has replayed everything sent."""

    def send(self, moves: bytes) -> None: ...

    def parts(self) -> list[Part]: ...

    def close(self) -> None: ...


class LocalShards:
    """The shards in this process, one after the other (the reference run)."""

    def __init__(self, settings: Sequence[dict[str, Any]]) -> None:
        self.shards = [LaneShard(s) for s in settings]

    def send(self, moves: bytes) -> None:
        for shard in self.shards:
            shard.run(pickle.loads(moves))

    def parts(self) -> list[Part]:
        return [shard.part() for shard in self.shards]

    def close(self) -> None:
        self.shards = []


def _shard_main(conn: Connection, settings: dict[str, Any]) -> None:
    """A shard process: moves in, its part out when asked; ends on None or a closed pipe."""
    shard = LaneShard(settings)
    while True:
        try:
            msg = conn.recv_bytes()
        except EOFError:
            return
        if msg == b"part":
            conn.send(shard.part())
        elif msg == b"stop":
            return
        else:
            shard.run(pickle.loads(msg))


class ProcessShards:
    """One process per shard (spawned: nothing of this process's threads or sockets goes along),
    a pipe each; a shard runs while this side goes on (sends only block on a full pipe)."""

    def __init__(self, settings: Sequence[dict[str, Any]]) -> None:
        ctx = mp.get_context("spawn")
        self._conns: list[Connection] = []
        self._procs: list[Any] = []
        for s in settings:
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=_shard_main, args=(theirs, s), name="shadow-lane-shard", daemon=True)
            proc.start()
            theirs.close()
            self._conns.append(mine)
            self._procs.append(proc)

    def send(self, moves: bytes) -> None:
        for conn in self._conns:
            conn.send_bytes(moves)

    def parts(self) -> list[Part]:
        for conn in self._conns:
            conn.send_bytes(b"part")
        return [conn.recv() for conn in self._conns]

    def close(self) -> None:
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.send_bytes(b"stop")
            conn.close()
        for proc in self._procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(10)
        self._conns, self._procs = [], []


class _RayShard:
    """A shard as a Ray actor (moves arrive pickled, in the order they were sent)."""

    def __init__(self, settings: dict[str, Any]) -> None:
        self.shard = LaneShard(settings)

    def run(self, moves: bytes) -> None:
        self.shard.run(pickle.loads(moves))

    def part(self) -> Part:
        return self.shard.part()


class RayShards:
    """One Ray actor per shard: `ray` is the imported module, `connect()` joins the cluster (called
    when this process has no Ray session yet; `shadow.app.serve.ray_shards` gives both); a session
    this process did not start is left running on close."""

    def __init__(self, settings: Sequence[dict[str, Any]], ray: Any, connect: Callable[[], None]) -> None:
        self._ray = ray
        self._owned = not ray.is_initialized()
        if self._owned:
            connect()
        actor = ray.remote(num_cpus=1)(_RayShard)
        self._actors = [actor.remote(s) for s in settings]
        self._pending: list[Any] = []

    def send(self, moves: bytes) -> None:
        ref = self._ray.put(moves)
        self._pending += [a.run.remote(ref) for a in self._actors]
        if len(self._pending) > 64 * len(self._actors):  # bound what is in flight
            self._ray.get(self._pending)
            self._pending = []

    def parts(self) -> list[Part]:
        self._ray.get(self._pending)  # (an actor's failure raises here)
        self._pending = []
        return list(self._ray.get([a.part.remote() for a in self._actors]))

    def close(self) -> None:
        for a in self._actors:
            self._ray.kill(a)
        self._actors = []
        if self._owned:
            self._ray.shutdown()


def deal(policies: Sequence[str], shards: int) -> list[list[str]]:
    """Policies dealt round-robin to at most `shards` non-empty shards."""
    if shards < 1:
        raise ValueError(f"lane shards must be >= 1, got {shards}")
    return [list(policies[i::shards]) for i in range(min(shards, len(policies)))]


class ShardedLanes:
    """See module docstring. `settings` are `LiveLanes`'s keyword arguments (picklable: no clock
    other than a module-level function); `runner(settings per shard)` starts the shards."""

    def __init__(self, settings: dict[str, Any], shards: int,
                 runner: Callable[[list[dict[str, Any]]], Shards] = LocalShards) -> None:
        policies = list(settings.get("policies", ()))
        if not policies:
            raise ValueError("lane shards need policies")
        self.policies = policies
        self.live = LiveLanes(**{**settings, "policies": ()})
        self.shards = runner([{**settings, "policies": p} for p in deal(policies, shards)])
        self._moves: list[Move] = []
        self.live.tee = self._tee
        self.sent = 0  # sends (each: every shard the same pickled moves)

    def _tee(self, kind: str, arg: Any) -> None:
        self._moves.append((kind, arg))
        if kind in ("advance", "drain"):  # a tick of the lanes ends with an advance: send per tick
            self.flush()

    def flush(self) -> None:
        """Send the moves not yet sent (one pickle for every shard)."""
        if self._moves:
            moves, self._moves = self._moves, []
            self.shards.send(pickle.dumps(moves, protocol=pickle.HIGHEST_PROTOCOL))
            self.sent += 1

    def report(self) -> Report:
        """The central report with every policy's lane, as one process gives it (the lanes' state
        at this moment: the central lanes wait meanwhile)."""
        with self.live._lock:
            return self._report()

    def _report(self) -> Report:
        self.flush()
        parts = self.shards.parts()
        live = self.live
        live._publish()
        rep = live.report().copy()
        actual = next(iter(rep["lanes"]))
        booked: dict[str, tuple[Sequence[WindowTotals], int]] = {actual: live.windows.booked(actual)}
        entries: dict[str, LaneReport] = {actual: rep["lanes"][actual]}
        for part in parts:
            booked.update(part["windows"])
            entries.update(part["lanes"])
        labels = [actual, *(spec.label for spec in map(LaneSpec.parse, self.policies))]
        windows = Windows.view(live.windows.window_s, {label: booked[label] for label in labels})
        g = len(live.workers)
        recent = {label: [w.figures(None, g) for w in windows.recent(label, RECENT_WINDOWS)]
                  for label in labels}
        rep["lanes"] = {
            label: {**entries[label], **window_fields(recent[label][-1] if recent[label] else None)}
            for label in labels
        }
        rep["windows"] = {**rep["windows"], "lanes": recent}
        rep["router_rule"] = router_rule(rep["lanes"])  # each shard compares its own lanes
        rep["comparison"] = comparison(windows, None, g, rep["comparison"]["problems"])
        # the driver's counts over its lanes: every shard counts its own actual lane, as the
        # central one does: each shard adds what it counts beyond that
        d = live.driver
        counts = {name: getattr(d, name) + sum(p["counters"][name] - getattr(d, name) for p in parts)
                  for name in PER_LANE_COUNTERS}
        rep["rolling"] = {**rep["rolling"], "windows_complete": windows.complete,
                          "reseeds": counts["reseeds"], "seed_unknown_worker": counts["seed_unknown_worker"]}
        # a request stays open until every lane is done with it: the central table lets it go when
        # its own (actual) lane is, each shard's when its lanes are; the most any process keeps (one
        # shard: the one-process figure; several: a lower bound on it)
        most = max([rep["requests"]["open"], *(p["open"] for p in parts)])
        rep["requests"] = {**rep["requests"], "open": most}
        return rep

    def close(self) -> None:
        self.shards.close()

"""The live driver's request table: what the events told of each request and of the fleet.

`RequestTable.apply(event)` folds Arrive/Route/Token/Finish/Cancel into one `LiveRequest` per
request, and keeps what the same events say of the fleet: the mirrored per-worker loads, the
per-step observations for the step-time estimate, the step budget (no lane can run more steps),
and the counts of events it could not use. A request whose worker, prompt and arrival are known is
queued (`queued(arrival, id)`: the driver releases it into the lanes at its arrival). It never
looks at the lanes; the driver removes requests once every lane is done with them. Pure: time
arrives in the events.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from shadow.contracts.events import Cancel, Event, Finish, Route, Step, Token
from shadow.contracts.requests import RequestRecord
from shadow.core.baselines import BODY_BYTES_PER_TOKEN
from shadow.engine.engineside import EngineSide
from shadow.engine.routerview import RouterViews
from shadow.engine.stepends import SAME_STEP_FRACTION

PROBE_SOURCES = ("probe", "probe_interval")  # step events of an engine probe (with its counts)


@dataclass(slots=True)
class LiveRequest(RequestRecord):
    """What the events told of a request, plus the driver's bookkeeping of it."""

    arrival: float | None = None  # its first Route: the lanes offer it then (after prefill in P/D)
    final: int | None = None
    released: bool = False
    queued: bool = False
    lanes_done: int = 0
    t_token: float = -1.0  # event time of the last token advance (SSE gap estimate)
    running: bool = False  # first token seen: holds KV on its worker (mirrored load)
    seq: int = -1  # its place in the release sequence (released: >= 0)
    g: int = -1  # its worker's index once known


class RequestTable:
    """See module docstring. `workers`: the decode worker names (index order); `queued(arrival,
    id)`: told once per request when it can be released; `engine`: the servers' measurements and
    the twin check, told of placements, ends and probe steps. `before(t)`, when set, runs first for
    every event (the driver takes the rolling seeds due by its time there)."""

    def __init__(self, workers: Sequence[str], max_requests: int, queued: Callable[[float, str], None],
                 engine: EngineSide) -> None:
        self.index = {name: g for g, name in enumerate(workers)}
        self.max_requests = max_requests
        self.reqs: dict[str, LiveRequest] = {}
        self._queued = queued
        self.engine = engine
        self.servers = engine.servers
        self.twin = engine.twin
        self.views: RouterViews | None = None  # the router's own view at each placement (if watched)
        self.before: Callable[[float], None] | None = None
        self.now = float("-inf")  # latest event time seen
        # mirrored per-worker KV load (running requests: first token seen), from the same events
        n = len(workers)
        self.mirror_loads: list[float] = [0.0] * n
        self.mirror_active: list[int] = [0] * n
        # ... and of every placed request not ended (running or queued at its worker), the twin of a
        # lane's loads + queued prompts
        self.mirror_placed: list[float] = [0.0] * n
        # output tokens seen plus requests released: no lane can run more steps (`checked_step`)
        self.step_budget = 0
        self.dropped: dict[str, int] = {}
        self.unknown_worker = 0
        # per-step observations for the step-time estimate (filled here, taken by the caller):
        # the per-token gaps of streams, one per token, per worker (`gaps[g]`; the last one: a
        # stream whose worker is not known; packed doubles: no float object kept per token, and a
        # numpy view without a copy); (worker, t, duration, period, source) of step events (worker
        # -1: none or not a known one; the period: the time since its previous busy step when
        # reported, else the duration); (worker, t, gap) once per step a worker made, from positive
        # token gaps: a chunk less than a tenth of its gap after the worker's previous one is
        # another stream's chunk of the same step
        self.gaps: list[array[float]] = [array("d") for _ in range(n + 1)]
        self.steps: list[tuple[int, float, float, float, str | None]] = []
        self.step_sources: dict[str, int] = {}  # step events by their `source` (probe, ...; "worker")
        self.worker_gap_ends: list[tuple[int, float, float]] = []
        self._gap_end = [float("-inf")] * n
        # False: the Tokens come one per stream per interval (`--token-interval`), not one per chunk:
        # their gaps are interval means (kept: the same sum and count) and one chunk per interval
        # shows no step, so the step ends are the node's (`Token.step_ends`), not found here
        self.stream_steps = True

    def take_gaps(self) -> list[array[float]]:
        """The per-token gaps per worker (the last one: no worker known) since the last take; the
        arrays are the caller's (new ones are appended to, so a numpy view of them is safe)."""
        out = self.gaps
        self.gaps = [array("d") for _ in out]
        return out

    def end_of(self, request_id: Hashable) -> tuple[int, int | None]:
        """Tokens seen of a request and its final length when known (a lane's `ends`)."""
        r = self.reqs.get(str(request_id))
        if r is None:  # cannot happen for a released request (kept until every lane is done)
            return 1, 1
        return r.generated, r.final

    def _drop(self, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1

    def apply(self, ev: Event) -> None:
        """Fold one event into the request table (never raises on odd input; counts it)."""
        if self.before is not None:
            self.before(ev.t)
        if ev.t > self.now:
            self.now = ev.t
        if isinstance(ev, Token):
            self._token(ev)
            return
        if isinstance(ev, Step):
            src = ev.source or "worker"
            self.step_sources[src] = self.step_sources.get(src, 0) + 1
            w = -1 if ev.worker is None else self.index.get(ev.worker, -1)
            period = ev.interval_s if ev.interval_s is not None else ev.duration_s
            self.steps.append((w, ev.t, ev.duration_s, period, ev.source))
            if (w >= 0 and ev.source in PROBE_SOURCES and ev.running is not None and ev.tokens is not None
                    and not ev.dummy):
                self.engine.probe_step(w, ev, ev.engine_interval_s or period, self.mirror_loads[w])
            return
        rid = ev.request_id
        if isinstance(ev, Route) and ev.worker not in self.index:
            self.unknown_worker += 1
            return
        r = self.reqs.get(rid)
        if r is None:
            if isinstance(ev, Finish | Cancel):
                self._drop("end_before_start")
                return
            if len(self.reqs) >= self.max_requests:
                self._drop("table_full")
                return
            r = self.reqs[rid] = LiveRequest()
        if isinstance(ev, Finish | Cancel):
            self._end(rid, r, ev)
            return
        r.learn(ev)  # the first size, key and worker known count (as in the offline feed)
        if isinstance(ev, Route) and r.arrival is None:
            r.arrival = ev.t
        if not r.queued and r.worker is not None and r.prompt is not None and r.arrival is not None:
            self._queue(rid, r, ev.t)

    def _queue(self, rid: str, r: LiveRequest, t: float) -> None:
        """Worker, prompt and arrival known: placed on its worker, to be released at its arrival."""
        assert r.worker is not None and r.prompt is not None and r.arrival is not None
        r.queued = True
        g = self.index[r.worker]
        if self.views is not None:
            prompt = max(1, r.prompt)
            size = BODY_BYTES_PER_TOKEN * prompt if r.body_bytes is None else r.body_bytes
            self.views.placed(rid, g, prompt, size, self.mirror_active, self.mirror_loads)
        self.mirror_placed[g] += r.held
        self._queued(r.arrival, rid)
        if self.servers is not None:
            self.servers.placed(g, r.arrival, rid, r.prompt)
        if self.twin is not None:
            self.twin.mirror(t, self.mirror_placed)

    def _token(self, ev: Token) -> None:
        r = self.reqs.get(ev.request_id)
        if r is None or r.final is not None:
            return
        generated = ev.generated
        dg = generated - r.generated
        if dg <= 0:
            return
        self.step_budget += dg
        t = ev.t
        g = r.g
        if g < 0 and r.worker is not None:
            g = r.g = self.index[r.worker]
        last = r.t_token
        r.t_token = t
        r.generated = generated
        if last >= 0:
            # dg tokens since the last event are dg decode steps (one token per step per running
            # stream), each the gap's share. Not only one-token advances: vLLM merges a stream's
            # tokens into one chunk when its HTTP side lags, and a merged chunk comes after a long
            # gap (one-token gaps only: step mean +14-24% at load average 15-19). Held Tokens give
            # each token of an interval the interval's mean gap: the same sum and count.
            gap = (t - last) / dg
            if dg == 1:
                self.gaps[g].append(gap)  # (g = -1: the last one, no worker)
            else:
                self.gaps[g].extend([gap] * dg)
            if g >= 0 and gap > 0 and self.stream_steps:
                ends = self._gap_end
                if t - ends[g] >= SAME_STEP_FRACTION * gap:
                    ends[g] = t
                    self.worker_gap_ends.append((g, t, gap))
        if not self.stream_steps and g >= 0 and ev.step_ends is not None:  # the node's (`StepEndFinder`)
            e = ev.step_ends
            self.worker_gap_ends += [(g, e[i], e[i + 1]) for i in range(0, len(e) - 1, 2)]
        if g >= 0:
            if r.queued:
                self.mirror_placed[g] += dg
                if self.twin is not None:
                    self.twin.mirror(t, self.mirror_placed)
            if not r.running:
                r.running = True
                self.mirror_active[g] += 1
                self.mirror_loads[g] += r.held
                if self.views is not None:
                    self.views.started(ev.request_id)
            else:
                self.mirror_loads[g] += dg

    def _end(self, rid: str, r: LiveRequest, ev: Finish | Cancel) -> None:
        if r.final is not None:
            return
        g = None if r.worker is None else self.index[r.worker]
        if isinstance(ev, Finish) and ev.generated is not None and ev.generated > r.generated:
            extra = ev.generated - r.generated  # tokens the Finish reports beyond the last Token
            self.step_budget += extra
            if r.queued and g is not None:
                self.mirror_placed[g] += extra
            if r.running and g is not None:
                self.mirror_loads[g] += extra  # released just below with the rest
            r.generated = ev.generated
        r.final = r.generated
        if self.views is not None:
            self.views.ended(rid)
        if r.queued and g is not None:
            self.mirror_placed[g] -= r.held
            if self.servers is not None:
                self.servers.ended(g, ev.t, rid, r.generated)
            if self.twin is not None:
                self.twin.mirror(ev.t, self.mirror_placed)
        if r.running and g is not None:
            self.mirror_active[g] -= 1
            self.mirror_loads[g] -= r.held
            r.running = False
        if not r.queued:
            del self.reqs[rid]
            self._drop("never_routed")
        elif r.generated < 1 and not r.released:
            # never released, and a request without tokens is no request (as the offline feed)
            r.queued = False
            self.reqs.pop(rid, None)
            if self.views is not None:
                self.views.forget(rid)
            self._drop("no_tokens")

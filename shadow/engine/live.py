"""Live driver: the same lanes as the offline driver, fed by normalised events as they happen;
lanes never see the future."""

from __future__ import annotations

import heapq
from array import array
from collections import deque
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial

from shadow.contracts.events import Cancel, Event, Finish, Route, Step, Token
from shadow.contracts.requests import RequestRecord
from shadow.core.baselines import BODY_BYTES_PER_TOKEN
from shadow.engine.config import DEFAULT_BLOCK_TOKENS, EngineConfig, LaneClock, LaneSpec
from shadow.engine.driver import LaneDriver, Observer
from shadow.engine.jobs import Job
from shadow.engine.lane import Clock, Lane, LaneTotals
from shadow.engine.rolling import Seed, SeedBook, Seeded, check_window
from shadow.engine.routerview import RouterViews
from shadow.engine.servertimes import ServerTimes
from shadow.engine.summary import LogHistogram
from shadow.engine.twincheck import TwinCheck

ACTUAL = "actual"
PROBE_SOURCES = ("probe", "probe_interval")  # step events of an engine probe (with its counts)
TWIN_WINDOW_S = 10.0  # the twin check's window (event time)


@dataclass(slots=True)
class _Live(RequestRecord):
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


class _TwinSide(Observer):
    """The `actual` lane's side of the twin check: each worker's state when a step of its ends,
    and the requests placed on it as they are."""

    def __init__(self, driver: LiveDriver, check: TwinCheck) -> None:
        self.driver, self.check = driver, check
        n = len(driver.workers)
        self.drains: list[list[tuple[float, float]]] = [[] for _ in range(n)]  # (until, tokens) heaps
        self.draining = [0.0] * n

    def drain(self, g: int, start: float, until: float, held: float) -> None:
        """The lane's `on_drain`: a finished request still placed on worker g until `until`."""
        heapq.heappush(self.drains[g], (until, held))
        self.draining[g] += held

    def _expire(self, g: int, upto: float, origin: float) -> None:
        drains = self.drains[g]
        while drains and drains[0][0] <= upto:
            until, held = heapq.heappop(drains)
            self.draining[g] -= held
            self.check.lane_placed(g, origin + until, -held)

    def offering(self, lane: Lane, job: Job) -> None:
        g = self.driver.assignment(job.request_id)
        origin = self.driver.origin
        if g is not None and origin is not None:
            self._expire(g, lane.now, origin)
            self.check.lane_placed(g, origin + lane.now, job.prompt_tokens)

    def stepped(self, lane: Lane) -> None:
        origin = self.driver.origin
        if origin is None:
            return
        c = lane.last_group
        end = lane.group_now(c)
        for g in lane.clock_groups[c]:
            self._expire(g, end, origin)
            bs = self.driver.block_tokens(lane, g)
            placed = lane.loads[g] + lane.queued_tokens[g] + self.draining[g]
            self.check.lane(g, origin + end, placed, lane.engine_running(g), lane.kv_blocks(g, bs) * bs)
        for g in range(len(self.drains)):
            self._expire(g, lane.now, origin)
        self.check.lane_clock(origin + lane.now)


def _streaming_totals() -> LaneTotals:
    return LaneTotals(
        ttft_s=LogHistogram(), tpot_s=LogHistogram(), wait_s=LogHistogram(), decision_s=LogHistogram()
    )


class LiveDriver:
    """Lanes fed by events; `workers` are the configured decode worker names (index order).

    `apply(event)` folds Arrive/Route/Token/Finish/Cancel into a request table; `advance_to(t)`
    moves every lane up to `t − lag` on the event clock. A request enters the lanes (in arrival
    order, like `run_lanes`) once its arrival is at or before that horizon and its
    decode worker and prompt size are known. Lanes never see the future: an output length is taken
    only from the request's Finish/Cancel (or a lower bound from its Token counts); a lane step that
    needs an end not yet known is held and counted (`LaneTotals.stalls`). `drain()` releases
    everything known and runs the lanes as far as knowledge allows (the end of a session).

    With the same requests, arrival times and step model, the lanes go through exactly the steps
    `run_offline` does on the recorded session (the consistency the tests check). Memory: requests
    leave the table once every lane has finished them; samples are bounded (`LogHistogram`).
    Pure: time arrives in events and arguments; `clock` only times decisions.

    Rolling (`rolling_s` = W): at every boundary n·W of lane time each lane is re-seeded
    (`Lane.reseed`) from the mirrored fleet at event time origin + n·W (`rolling.Seed`, taken as
    the first event at or after it is applied, or when the horizon passes it), so a lane's drift
    from reality, its lag and what it holds stay bounded by one window. New seeds wait in
    `seeds.new` for the caller (a recorder). A replay passes the recorded `seeds` (and their
    `origin`) instead: the lanes start each window from the same state as they did live. A lane
    more than `max_lag_s` (default W) behind its horizon is cut: re-seeded at the latest boundary
    the horizon passed (`cuts`), so its lag stays within lag_s + max(max_lag_s, W).
    """

    def __init__(
        self,
        config: EngineConfig,
        specs: Sequence[LaneSpec],
        workers: Sequence[str],
        clock: Clock,
        *,
        lag_s: float = 2.0,
        actual: bool = True,
        max_requests: int = 1_000_000,
        rolling_s: float | None = None,
        seeds: Mapping[int, Seed] | None = None,
        origin: float | None = None,
        max_lag_s: float | None = None,
        servers: bool = True,
        twin_window_s: float = TWIN_WINDOW_S,
    ) -> None:
        if config.workers != len(workers):
            raise ValueError(f"config has {config.workers} workers but {len(workers)} are named")
        if lag_s < 0:
            raise ValueError(f"lag must be >= 0 s, got {lag_s}")
        self.config = config
        self.workers = list(workers)
        self.index = {name: g for g, name in enumerate(workers)}
        self.lag_s = lag_s
        self.max_requests = max_requests
        self.rolling_s = check_window(rolling_s)
        # rolling: a lane further behind its horizon (now − lag) than this is re-seeded at the latest
        # boundary the horizon passed (default W): its lag stays within lag_s + max(max_lag_s, W)
        self.max_lag_s = (None if self.rolling_s is None
                          else self.rolling_s if max_lag_s is None else max_lag_s)
        if self.max_lag_s is not None and not self.max_lag_s > 0:
            raise ValueError(f"max lag must be > 0 s, got {max_lag_s!r}")
        if seeds is not None and self.rolling_s is None:
            raise ValueError("recorded seeds need the rolling window they were taken with")
        self._snap_until = float("-inf")  # event time up to which the table is the fleet's state
        self.reseeds = 0
        self.seed_unknown_worker = 0
        self.cuts: dict[str, int] = {}  # per lane: windows cut short (re-seeded ahead: too far behind)
        self._reqs: dict[str, _Live] = {}
        self._assign: dict[Hashable, int] = {}
        all_specs = ([LaneSpec("forced", name=ACTUAL)] if actual else []) + list(specs)
        labels = [s.label for s in all_specs]
        if len(set(labels)) != len(labels):
            raise ValueError(f"lane labels must be unique, got {labels}")
        self.lanes: list[Lane] = []
        self._drivers: list[LaneDriver] = []
        for spec in all_specs:
            lane = Lane(spec, config, clock, self._assign if spec.policy == "forced" else None, ends=self)
            lane.totals = _streaming_totals()
            lane.on_done = self._lane_done
            self.lanes.append(lane)
            i = len(self._drivers)
            self._drivers.append(
                LaneDriver(lane, budget=partial(self._lane_budget, i), window_s=self.rolling_s,
                           on_boundary=None if self.rolling_s is None else self._reseed)
            )
        self._pending: list[tuple[float, int, str]] = []  # (arrival, tie, id) releasable, not released
        self._tie = 0
        self._released: deque[Job] = deque()
        self._base = 0  # index of _released[0] in the release sequence
        self._cursor = [0] * len(self.lanes)
        self._budget_offset = [0] * len(self.lanes)
        self.origin: float | None = origin  # event time of lane time 0
        self.seeds = SeedBook(self.rolling_s or 1.0, len(self.lanes), seeds)
        self.last_release = float("-inf")
        self.now = float("-inf")  # latest event time seen
        self.horizon = float("-inf")
        # mirrored per-worker KV load (running requests: first token seen), from the same events
        self.mirror_loads: list[float] = [0.0] * len(workers)
        self.mirror_active: list[int] = [0] * len(workers)
        # ... and of every placed request not ended (running or queued at its worker), the twin of a
        # lane's loads + queued prompts
        self.mirror_placed: list[float] = [0.0] * len(workers)
        # counters
        self.released = 0
        # output tokens seen plus requests released: no lane can run more steps (`checked_step`)
        self._step_budget = 0
        self.late = 0  # released after lanes had passed their arrival
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
        self.gaps: list[array[float]] = [array("d") for _ in range(len(workers) + 1)]
        self.steps: list[tuple[int, float, float, float, str | None]] = []
        self.step_sources: dict[str, int] = {}  # step events by their `source` (probe, ...; "worker")
        self.worker_gap_ends: list[tuple[int, float, float]] = []
        self._gap_end = [float("-inf")] * len(workers)
        # the servers around their engines (`ServerTimes`, from engine probe steps): the lanes take
        # their latencies and host speed once a probe reports steps (`servers`: on)
        n = len(workers)
        self.servers: ServerTimes | None = ServerTimes(n, [config.step] * n) if servers else None
        self._serving = False  # the lanes step on the servers' measurements
        # the router's own view at each placement (`watch_router`: for the agreement ledger)
        self.views: RouterViews | None = None
        self.twin: TwinCheck | None = None
        if actual:
            self.twin = TwinCheck(n, twin_window_s, self._kv_tokens, names=self.workers)
            side = _TwinSide(self, self.twin)
            self.observe(side, ACTUAL)
            self.lanes[0].on_drain = side.drain

    def take_gaps(self) -> list[array[float]]:
        """The per-token gaps per worker (the last one: no worker known) since the last take; the
        arrays are the caller's (the driver appends to new ones, so a numpy view of them is safe)."""
        out = self.gaps
        self.gaps = [array("d") for _ in out]
        return out

    def _lane_budget(self, i: int) -> float:
        return self._step_budget + self._budget_offset[i]

    def observe(self, observer: Observer, label: str | None = None) -> None:
        """Tell `observer` what the lane called `label` does (every lane when None)."""
        for driver in self._drivers:
            if label is None or driver.lane.spec.label == label:
                driver.observers.append(observer)

    # -- events ------------------------------------------------------------------------------

    def watch_router(self) -> RouterViews:
        """Keep the router's own view at each placement from now on (`RouterViews`)."""
        if self.views is None:
            self.views = RouterViews(len(self.workers))
        return self.views

    def end_of(self, request_id: Hashable) -> tuple[int, int | None]:
        r = self._reqs.get(str(request_id))
        if r is None:  # cannot happen for a released request (kept until every lane is done)
            return 1, 1
        return r.generated, r.final

    def _drop(self, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1

    def apply(self, ev: Event) -> None:
        """Fold one event into the request table (never raises on odd input; counts it)."""
        if self.rolling_s is not None and self.origin is not None:
            self._take_seeds(ev.t)
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
                self._probe_step(w, ev, ev.engine_interval_s or period)
            return
        rid = ev.request_id
        if isinstance(ev, Route) and ev.worker not in self.index:
            self.unknown_worker += 1
            return
        r = self._reqs.get(rid)
        if r is None:
            if isinstance(ev, Finish | Cancel):
                self._drop("end_before_start")
                return
            if len(self._reqs) >= self.max_requests:
                self._drop("table_full")
                return
            r = self._reqs[rid] = _Live()
        if isinstance(ev, Finish | Cancel):
            self._end(rid, r, ev)
            return
        r.learn(ev)  # the first size, key and worker known count (as in the offline feed)
        if isinstance(ev, Route) and r.arrival is None:
            r.arrival = ev.t
        if not r.queued and r.worker is not None and r.prompt is not None and r.arrival is not None:
            r.queued = True
            g = self.index[r.worker]
            if self.views is not None:
                prompt = max(1, r.prompt)
                size = BODY_BYTES_PER_TOKEN * prompt if r.body_bytes is None else r.body_bytes
                self.views.placed(rid, g, prompt, size, self.mirror_active, self.mirror_loads)
            self.mirror_placed[g] += r.held
            self._tie += 1
            heapq.heappush(self._pending, (r.arrival, self._tie, rid))
            if self.servers is not None:
                self.servers.placed(g, r.arrival, rid, r.prompt)
            if self.twin is not None:
                self.twin.mirror(ev.t, self.mirror_placed)

    def _probe_step(self, g: int, ev: Step, period: float) -> None:
        """An engine probe's step of worker g (with its counts): to the servers' measurements and
        the twin check's engine side."""
        assert ev.running is not None and ev.tokens is not None
        if self.servers is not None:
            scheduled = (None if ev.decode_requests is None or ev.prefill_requests is None
                         else ev.decode_requests + ev.prefill_requests)
            self.servers.step(g, ev.t, period, ev.running, ev.waiting or 0, ev.tokens, ev.preemptions or 0,
                              ev.kv_usage, self.mirror_loads[g], scheduled=scheduled,
                              prefill_tokens=ev.prefill_tokens)
            self._serving = True
        if self.twin is not None:
            self.twin.engine(g, ev.t, ev.running, ev.kv_usage or 0.0)

    def _kv_tokens(self, g: int) -> float | None:
        return None if self.servers is None else self.servers.kv_tokens(g)

    def block_tokens(self, lane: Lane, g: int) -> int:
        """The KV block size worker g's engine counts in: measured (`ServerTimes`), else the lane's
        configured one."""
        default = lane.limits.block_tokens if lane.limits is not None else DEFAULT_BLOCK_TOKENS
        measured = None if self.servers is None else self.servers.block_tokens(g)
        return measured or default

    def _token(self, ev: Token) -> None:
        r = self._reqs.get(ev.request_id)
        if r is None or r.final is not None:
            return
        generated = ev.generated
        dg = generated - r.generated
        if dg <= 0:
            return
        self._step_budget += dg
        t = ev.t
        g = r.g
        if g < 0 and r.worker is not None:
            g = r.g = self.index[r.worker]
        last = r.t_token
        r.t_token = t
        r.generated = generated
        if last >= 0:
            # dg tokens since the last event are dg decode steps (one token per step per running
            # stream), each the gap's share. Not only one-token advances: a busy tap coalesces a
            # stream's chunks per analysis batch, and a chunk is alone in its batch when the gaps
            # around it are long (one-token gaps only: step mean +14-24% at load average 15-19).
            gap = (t - last) / dg
            if dg == 1:
                self.gaps[g].append(gap)  # (g = -1: the last one, no worker)
            else:
                self.gaps[g].extend([gap] * dg)
            if g >= 0 and gap > 0:
                ends = self._gap_end
                if t - ends[g] >= 0.1 * gap:
                    ends[g] = t
                    self.worker_gap_ends.append((g, t, gap))
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

    def _end(self, rid: str, r: _Live, ev: Finish | Cancel) -> None:
        if r.final is not None:
            return
        g = None if r.worker is None else self.index[r.worker]
        if isinstance(ev, Finish) and ev.generated is not None and ev.generated > r.generated:
            extra = ev.generated - r.generated  # tokens the Finish reports beyond the last Token
            self._step_budget += extra
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
            del self._reqs[rid]
            self._drop("never_routed")
        elif r.generated < 1 and not r.released:
            # never released, and a request without tokens is no request (as the offline feed)
            r.queued = False
            self._reqs.pop(rid, None)
            if self.views is not None:
                self.views.forget(rid)
            self._drop("no_tokens")

    def _lane_done(self, request_id: Hashable) -> None:
        rid = str(request_id)
        r = self._reqs.get(rid)
        if r is None:
            return
        r.lanes_done += 1
        self._forget(rid, r)

    def _forget(self, rid: str, r: _Live) -> None:
        """Out of the table once every lane is done with it and no seed still to be used holds it."""
        if r.lanes_done >= len(self.lanes) and not self.seeds.holds(rid):
            del self._reqs[rid]
            self._assign.pop(rid, None)
            if self.views is not None:
                self.views.forget(rid)

    # -- rolling -----------------------------------------------------------------------------

    def run_lanes_to(self, lane_t: float) -> None:
        """A replay's end: every lane idle or running up to lane time `lane_t` (as far as known)."""
        for i, driver in enumerate(self._drivers):
            if self._offer_released(i, driver):
                driver.advance(lane_t)

    def know(self, seeded: Seeded, output_tokens: int, body_bytes: int | None = None) -> None:
        """A replay of one window: a request its seed holds that arrived before the window, with
        its recorded output length and body size (it enters the lanes only through the seed)."""
        if seeded.request_id not in self._reqs:
            self._reqs[seeded.request_id] = _Live(
                seeded.worker, seeded.prompt, seeded.key, output_tokens, body_bytes, arrival=seeded.arrival,
                final=output_tokens, queued=True)

    def _take_seeds(self, upto: float) -> None:
        """Take the seeds of every boundary at or before event time `upto` not taken yet: the
        table as it is now (the events before the boundary) is the fleet at the boundary."""
        assert self.rolling_s is not None and self.origin is not None
        for n in self.seeds.due(self.origin, upto):
            reqs = tuple(sorted(
                (Seeded(rid, r.worker, r.arrival, r.prompt, r.generated if r.running else 0, r.key)
                 for rid, r in self._reqs.items()
                 if r.queued and r.final is None and r.worker is not None and r.prompt is not None
                 and r.arrival is not None),
                key=lambda s: (s.arrival, s.request_id),
            ))
            self.seeds.add(Seed(n, self.origin + n * self.rolling_s, self.origin, self.rolling_s, reqs,
                                self._step_budget))

    def _seed(self, n: int) -> Seed | None:
        if self.origin is not None and n >= self.seeds.next:
            self._take_seeds(min(self._snap_until, self.origin + n * (self.rolling_s or 0.0)))
        return self.seeds.get(n)

    def _catch_up(self, i: int, driver: LaneDriver, lane_t: float) -> None:
        """Lane `i` is too far behind: cut its window and re-seed it at the latest boundary the
        horizon reached (its figures for the cut window are marked, never compared)."""
        assert self.rolling_s is not None
        n = int(lane_t // self.rolling_s)
        if n < driver.next_boundary:
            return  # no boundary ahead of it yet: it is behind within one window
        label = driver.lane.spec.label
        self.cuts[label] = self.cuts.get(label, 0) + 1
        for m in driver.jump(n):
            self._used(m)
        # released jobs it never took that arrived before the boundary: ended before it, not seeded
        lane, at = driver.lane, n * self.rolling_s
        released, cur = self._released, self._cursor[i]
        while cur - self._base < len(released) and released[cur - self._base].arrival_s < at:
            rid = released[cur - self._base].request_id
            if rid not in lane.seeded:
                self._lane_done(rid)
            cur += 1
        self._cursor[i] = cur
        if self._offer_released(i, driver):
            driver.advance(lane_t)

    def _reseed(self, lane: Lane, n: int) -> None:
        """Lane `lane` reached boundary n: start it again from seed n (none: it goes on as it is)."""
        i = self.lanes.index(lane)
        seed = self._seed(n)
        if seed is not None and self.origin is not None:
            running: list[tuple[int, Job, int]] = []
            waiting: list[tuple[Job, float]] = []
            for s in seed.requests:
                g = self.index.get(s.worker)
                if g is None:
                    self.seed_unknown_worker += 1
                    continue
                r = self._reqs.get(s.request_id)
                if r is None:  # a replay: in flight when the recording ended (its end never known)
                    r = self._reqs[s.request_id] = _Live(s.worker, s.prompt, s.key, s.generated,
                                                         arrival=s.arrival, queued=True,
                                                         running=s.generated >= 1)
                self._assign[s.request_id] = g
                job = Job(s.request_id, s.arrival - self.origin, max(1, s.prompt), 1, s.key, r.body_bytes)
                if s.generated >= 1:
                    running.append((g, job, s.generated))
                else:
                    waiting.append((job, job.arrival_s))
            dropped = lane.reseed(n * seed.window_s, running, waiting)
            self.reseeds += 1
            seeded = lane.seeded
            for rid in dropped:
                if rid not in seeded:
                    self._lane_done(rid)
            cursor = self._cursor[i]
            done = set(dropped)
            for rid in seeded:
                r = self._reqs.get(str(rid))
                if rid not in done and r is not None and 0 <= r.seq < cursor:
                    r.lanes_done -= 1  # the lane had finished it: it holds it again
                    lane.again.add(rid)
            # steps in this window: bounded by the tokens seen since the seed was taken
            self._budget_offset[i] = lane.k - seed.budget
        self._used(n)

    def _used(self, n: int) -> None:
        """One more lane is past boundary n: its seed goes once every lane is."""
        for rid in self.seeds.used(n):
            r = self._reqs.get(rid)
            if r is not None and r.released:
                self._forget(rid, r)

    # -- time --------------------------------------------------------------------------------

    def _release(self, horizon: float) -> None:
        pending = self._pending
        while pending and pending[0][0] <= horizon:
            arrival, _, rid = heapq.heappop(pending)
            r = self._reqs.get(rid)
            if r is None or not r.queued or r.released:
                continue  # dropped meanwhile (ended without tokens)
            assert r.worker is not None and r.prompt is not None
            if self.origin is None:
                self.origin = arrival
            if arrival < self.last_release:
                self.late += 1
            self.last_release = max(self.last_release, arrival)
            r.released = True
            r.seq = self._base + len(self._released)
            self._assign[rid] = self.index[r.worker]
            self._released.append(Job(rid, arrival - self.origin, max(1, r.prompt), 1, r.key, r.body_bytes))
            self.released += 1
            self._step_budget += 1  # a request runs at least one step

    def advance_to(self, t: float) -> None:
        """Move every lane up to event time `t − lag` (as far as known ends allow)."""
        self._advance(t - self.lag_s, drain=False)

    def drain(self) -> None:
        """Release every request known and run the lanes as far as known ends allow."""
        self._advance(float("inf"), drain=True)

    def _advance(self, horizon: float, drain: bool) -> None:
        self.horizon = max(self.horizon, horizon)
        # the table is the fleet's state up to the horizon (+ lag) when no later event came
        self._snap_until = max(self._snap_until, self.now if drain else horizon + self.lag_s)
        self._release(horizon)
        if self.origin is None:
            return
        lane_t = horizon - self.origin
        self._serve_lanes()
        for i, driver in enumerate(self._drivers):
            # a lane held by an unknown end before its next job cannot run further either
            if self._offer_released(i, driver):
                if drain:
                    driver.run_out()
                else:
                    driver.advance(lane_t)
            if not drain and self.max_lag_s is not None and lane_t - driver.lane.now > self.max_lag_s:
                self._catch_up(i, driver, lane_t)
        low = min(self._cursor)
        while self._base < low:
            self._released.popleft()
            self._base += 1
        if self.twin is not None:
            self.twin.settle(self.now)

    def _offer_released(self, i: int, driver: LaneDriver) -> bool:
        """Offer lane `i` the released jobs it has not seen, each at its arrival; False when the
        lane is held by an unknown end before reaching the next one."""
        released, base = self._released, self._base
        cur = self._cursor[i]
        try:
            lane = driver.lane
            while cur - base < len(released):
                job = released[cur - base]
                if job.request_id in lane.seeded:
                    cur += 1  # released after the boundary whose seed put it in the lane
                    continue
                self._cursor[i] = cur  # a re-seed while advancing to the job reads it
                if not driver.offer(job, job.arrival_s):
                    return False
                cur += 1
            return True
        finally:
            self._cursor[i] = cur

    # -- views -------------------------------------------------------------------------------

    def set_clock(self, clock: LaneClock) -> None:
        """Step every lane on `clock` from now on (see `Lane.set_clock`)."""
        for lane in self.lanes:
            lane.set_clock(clock)
        if self.servers is not None:
            self.servers.set_models(clock.models or (self.config.step,) * len(self.workers))

    def _serve_lanes(self) -> None:
        """Once an engine probe reports steps: every lane at the host's measured speed, with the
        servers' measured latencies (`ServerTimes`)."""
        servers = self.servers
        if servers is None or not self._serving:
            return
        lat = servers.latencies()
        for lane in self.lanes:
            if lane.speed is None:
                lane.set_speed(self._speed)
            if lat is not None and (lane.front_s, lane.back_s) != lat:
                lane.set_latency(*lat)

    def _speed(self, g: int, lane_t: float) -> float:
        assert self.servers is not None
        return self.servers.speed(g, lane_t + (self.origin or 0.0))

    def lag(self, lane: Lane) -> float:
        """How far `lane` runs behind the newest event time (seconds)."""
        if self.origin is None:
            return 0.0
        return max(0.0, self.now - (lane.now + self.origin))

    def assignment(self, request_id: Hashable) -> int | None:
        """The worker index the real router chose for a released request."""
        return self._assign.get(request_id)

    def open_requests(self) -> int:
        return len(self._reqs)

"""Live driver: the same lanes as the offline driver, fed by normalised events as they happen;
lanes never see the future.

Its collaborators: the request table the events fold into (`shadow.engine.livetable`), the
release sequence the lanes are offered from (`shadow.engine.releases`), the rolling windows'
seeds (`shadow.engine.seeding`) and the real engines' measurements and twin check
(`shadow.engine.engineside`)."""

from __future__ import annotations

from array import array
from collections.abc import Callable, Hashable, Mapping, Sequence
from functools import partial

from shadow.contracts.events import Event
from shadow.engine.config import EngineConfig, LaneClock, LaneSpec
from shadow.engine.driver import LaneDriver, Observer
from shadow.engine.engineside import EngineSide, TwinSide
from shadow.engine.jobs import Job
from shadow.engine.lane import Clock, Lane, LaneTotals
from shadow.engine.livetable import PROBE_SOURCES, LiveRequest, RequestTable
from shadow.engine.releases import Releases
from shadow.engine.rolling import Seed, SeedBook, Seeded, check_window
from shadow.engine.routerview import RouterViews
from shadow.engine.seeding import seed_jobs, take_seed
from shadow.engine.servertimes import ServerTimes
from shadow.engine.summary import LogHistogram
from shadow.engine.twincheck import TwinCheck

__all__ = ["ACTUAL", "PROBE_SOURCES", "TWIN_WINDOW_S", "LiveDriver"]

ACTUAL = "actual"
TWIN_WINDOW_S = 10.0  # the twin check's window (event time)
DEFAULT_LAG_S = 2.0  # how far lanes run behind the live clock (`shadow serve --lag`'s default)


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

    apply: Callable[[Event], None]  # fold one event into the request table (`RequestTable.apply`)

    def __init__(
        self,
        config: EngineConfig,
        specs: Sequence[LaneSpec],
        workers: Sequence[str],
        clock: Clock,
        *,
        lag_s: float = DEFAULT_LAG_S,
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
        self._assign: dict[Hashable, int] = {}
        all_specs = ([LaneSpec("forced", name=ACTUAL)] if actual else []) + list(specs)
        labels = [s.label for s in all_specs]
        if len(set(labels)) != len(labels):
            raise ValueError(f"lane labels must be unique, got {labels}")
        self.releases = Releases(len(all_specs))
        # the servers around their engines (`ServerTimes`, from engine probe steps): the lanes take
        # their latencies and host speed once a probe reports steps (`servers`: on); the twin check
        self.engine = EngineSide(self.workers, config.step, servers=servers,
                                 twin_window_s=twin_window_s if actual else None)
        self.servers: ServerTimes | None = self.engine.servers
        self.twin: TwinCheck | None = self.engine.twin
        self.table = RequestTable(self.workers, max_requests, self.releases.push, self.engine)
        self.index = self.table.index
        self.apply = self.table.apply  # bound: the per-event path has no extra call
        self.lanes: list[Lane] = []
        self._drivers: list[LaneDriver] = []
        for spec in all_specs:
            self._add_lane(spec, config, clock)
        self._budget_offset = [0] * len(self.lanes)
        self.origin: float | None = origin  # event time of lane time 0
        self.seeds = SeedBook(self.rolling_s or 1.0, len(self.lanes), seeds)
        self._watch_seeds()
        self.last_release = float("-inf")
        self.horizon = float("-inf")
        self.released = 0
        self.late = 0  # released after lanes had passed their arrival
        # the router's own view at each placement (`watch_router`: for the agreement ledger)
        self.views: RouterViews | None = None
        if self.twin is not None:
            side = TwinSide(self, self.engine, self.twin, len(self.workers))
            self.observe(side, ACTUAL)
            self.lanes[0].on_drain = side.drain

    def _add_lane(self, spec: LaneSpec, config: EngineConfig, clock: Clock) -> None:
        lane = Lane(spec, config, clock, self._assign if spec.policy == "forced" else None, ends=self.table)
        lane.totals = _streaming_totals()
        lane.on_done = self._lane_done
        self.lanes.append(lane)
        i = len(self._drivers)
        self._drivers.append(
            LaneDriver(lane, budget=partial(self._lane_budget, i), window_s=self.rolling_s,
                       on_boundary=None if self.rolling_s is None else self._reseed)
        )

    def _watch_seeds(self) -> None:
        """Rolling, once lane time 0 is known: every event first takes the seeds due by its time."""
        if self.rolling_s is not None and self.origin is not None:
            self.table.before = self._take_seeds

    # -- the request table's figures ---------------------------------------------------------

    @property
    def now(self) -> float:
        """The latest event time seen."""
        return self.table.now

    @property
    def mirror_loads(self) -> list[float]:
        """Mirrored per-worker KV load (running requests: first token seen)."""
        return self.table.mirror_loads

    @property
    def mirror_active(self) -> list[int]:
        """Mirrored running requests per worker."""
        return self.table.mirror_active

    @property
    def mirror_placed(self) -> list[float]:
        """Mirrored load of every placed request not ended (running or queued at its worker)."""
        return self.table.mirror_placed

    @property
    def steps(self) -> list[tuple[int, float, float, float, str | None]]:
        """(worker, t, duration, period, source) of the step events not taken yet."""
        return self.table.steps

    @property
    def step_sources(self) -> dict[str, int]:
        """Step events by their `source` (probe, ...; "worker")."""
        return self.table.step_sources

    @property
    def dropped(self) -> dict[str, int]:
        """Requests the table left out, by reason."""
        return self.table.dropped

    @property
    def unknown_worker(self) -> int:
        """Routes to a worker not configured."""
        return self.table.unknown_worker

    def take_gaps(self) -> list[array[float]]:
        """The per-token gaps per worker since the last take (`RequestTable.take_gaps`)."""
        return self.table.take_gaps()

    def end_of(self, request_id: Hashable) -> tuple[int, int | None]:
        return self.table.end_of(request_id)

    def _lane_budget(self, i: int) -> float:
        return self.table.step_budget + self._budget_offset[i]

    def observe(self, observer: Observer, label: str | None = None) -> None:
        """Tell `observer` what the lane called `label` does (every lane when None)."""
        for driver in self._drivers:
            if label is None or driver.lane.spec.label == label:
                driver.observers.append(observer)

    def watch_router(self) -> RouterViews:
        """Keep the router's own view at each placement from now on (`RouterViews`)."""
        if self.views is None:
            self.views = self.table.views = RouterViews(len(self.workers))
        return self.views

    def block_tokens(self, lane: Lane, g: int) -> int:
        """The KV block size worker g's engine counts in (`EngineSide.block_tokens`)."""
        return self.engine.block_tokens(lane, g)

    def _lane_done(self, request_id: Hashable) -> None:
        rid = str(request_id)
        r = self.table.reqs.get(rid)
        if r is None:
            return
        r.lanes_done += 1
        self._forget(rid, r)

    def _forget(self, rid: str, r: LiveRequest) -> None:
        """Out of the table once every lane is done with it and no seed still to be used holds it."""
        if r.lanes_done >= len(self.lanes) and not self.seeds.holds(rid):
            del self.table.reqs[rid]
            self._assign.pop(rid, None)
            if self.views is not None:
                self.views.forget(rid)

    # -- rolling -----------------------------------------------------------------------------

    def run_lanes_to(self, lane_t: float) -> None:
        """A replay's end: every lane idle or running up to lane time `lane_t` (as far as known)."""
        for i, driver in enumerate(self._drivers):
            if self.releases.offer(i, driver):
                driver.advance(lane_t)

    def know(self, seeded: Seeded, output_tokens: int, body_bytes: int | None = None) -> None:
        """A replay of one window: a request its seed holds that arrived before the window, with
        its recorded output length and body size (it enters the lanes only through the seed)."""
        reqs = self.table.reqs
        if seeded.request_id not in reqs:
            reqs[seeded.request_id] = LiveRequest(
                seeded.worker, seeded.prompt, seeded.key, output_tokens, body_bytes, arrival=seeded.arrival,
                final=output_tokens, queued=True)

    def _take_seeds(self, upto: float) -> None:
        """Take the seeds of every boundary at or before event time `upto` not taken yet: the
        table as it is now (the events before the boundary) is the fleet at the boundary."""
        assert self.rolling_s is not None and self.origin is not None
        for n in self.seeds.due(self.origin, upto):
            self.seeds.add(take_seed(n, self.table.reqs, self.origin, self.rolling_s, self.table.step_budget))

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
        self.releases.skip(i, n * self.rolling_s, driver.lane.seeded, self._lane_done)
        if self.releases.offer(i, driver):
            driver.advance(lane_t)

    def _reseed(self, lane: Lane, n: int) -> None:
        """Lane `lane` reached boundary n: start it again from seed n (none: it goes on as it is)."""
        i = self.lanes.index(lane)
        seed = self._seed(n)
        if seed is not None and self.origin is not None:
            reqs = self.table.reqs
            running, waiting, unknown = seed_jobs(seed, self.index, reqs, self._assign, self.origin)
            self.seed_unknown_worker += unknown
            dropped = lane.reseed(n * seed.window_s, running, waiting)
            self.reseeds += 1
            seeded = lane.seeded
            for rid in dropped:
                if rid not in seeded:
                    self._lane_done(rid)
            cursor = self.releases.cursor[i]
            done = set(dropped)
            for rid in seeded:
                r = reqs.get(str(rid))
                if rid not in done and r is not None and 0 <= r.seq < cursor:
                    r.lanes_done -= 1  # the lane had finished it: it holds it again
                    lane.again.add(rid)
            # steps in this window: bounded by the tokens seen since the seed was taken
            self._budget_offset[i] = lane.k - seed.budget
        self._used(n)

    def _used(self, n: int) -> None:
        """One more lane is past boundary n: its seed goes once every lane is."""
        for rid in self.seeds.used(n):
            r = self.table.reqs.get(rid)
            if r is not None and r.released:
                self._forget(rid, r)

    # -- time --------------------------------------------------------------------------------

    def _release(self, horizon: float) -> None:
        reqs, releases = self.table.reqs, self.releases
        for arrival, rid in releases.due(horizon):
            r = reqs.get(rid)
            if r is None or not r.queued or r.released:
                continue  # dropped meanwhile (ended without tokens)
            assert r.worker is not None and r.prompt is not None
            if self.origin is None:
                self.origin = arrival
                self._watch_seeds()
            if arrival < self.last_release:
                self.late += 1
            self.last_release = max(self.last_release, arrival)
            r.released = True
            self._assign[rid] = self.index[r.worker]
            r.seq = releases.add(Job(rid, arrival - self.origin, max(1, r.prompt), 1, r.key, r.body_bytes))
            self.released += 1
            self.table.step_budget += 1  # a request runs at least one step

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
        self.engine.serve(self.lanes, self.origin)
        for i, driver in enumerate(self._drivers):
            # a lane held by an unknown end before its next job cannot run further either
            if self.releases.offer(i, driver):
                if drain:
                    driver.run_out()
                else:
                    driver.advance(lane_t)
            if not drain and self.max_lag_s is not None and lane_t - driver.lane.now > self.max_lag_s:
                self._catch_up(i, driver, lane_t)
        self.releases.trim()
        if self.twin is not None:
            self.twin.settle(self.now)

    # -- views -------------------------------------------------------------------------------

    def set_clock(self, clock: LaneClock) -> None:
        """Step every lane on `clock` from now on (see `Lane.set_clock`)."""
        for lane in self.lanes:
            lane.set_clock(clock)
        self.engine.set_models(clock.models or (self.config.step,) * len(self.workers))

    def lag(self, lane: Lane) -> float:
        """How far `lane` runs behind the newest event time (seconds)."""
        if self.origin is None:
            return 0.0
        return max(0.0, self.now - (lane.now + self.origin))

    def assignment(self, request_id: Hashable) -> int | None:
        """The worker index the real router chose for a released request."""
        return self._assign.get(request_id)

    def open_requests(self) -> int:
        return len(self.table.reqs)

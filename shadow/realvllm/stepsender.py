"""A bounded, never-blocking hand-off of engine steps to a background thread that posts them as
`step` events (NDJSON) to a shadow event API. Standard library and orjson only: it runs inside vLLM.

`offer()` is the only call made on the engine's loop: one tuple appended to a bounded deque, or a
counted drop when it is full. The sender thread turns tuples into events and posts them in batches
over one keep-alive connection; a batch that cannot be posted is dropped and counted, never retried
into an unbounded backlog.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import threading
import time
import urllib.parse
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import orjson

DEFAULT_QUEUE = 4096
DEFAULT_BATCH = 512
DEFAULT_FLUSH_S = 0.1
DEFAULT_TIMEOUT_S = 2.0
ENV_URL = "SHADOW_PROBE_URL"
ENV_TOKEN = "SHADOW_PROBE_TOKEN"
ENV_WORKER = "SHADOW_PROBE_WORKER"
ENV_QUEUE = "SHADOW_PROBE_QUEUE"
ENV_FLUSH_MS = "SHADOW_PROBE_FLUSH_MS"

SOURCE_ELAPSED = "probe"  # duration_s is the engine's own elapsed time of the step
SOURCE_INTERVAL = "probe_interval"  # duration_s is the time since the previous busy step


class StepSample(NamedTuple):
    """One engine step as the stat logger saw it (t: time.monotonic() when it was recorded), and
    what the engine scheduled into it (the `step` event's fields of the same names)."""

    t: float
    engine: int
    elapsed_s: float | None
    running: int
    waiting: int
    kv_usage: float
    tokens: int
    preemptions: int
    prefill_tokens: int = 0
    prefill_requests: int = 0
    decode_requests: int | None = None
    iteration: int | None = None
    dummy: bool = False
    engine_interval_s: float | None = None
    run_s: float | None = None  # the engine's measured thread's (EngineSched) seconds on a CPU so far, at t
    wait_s: float | None = None  # ... and waiting, runnable, for one


def sample_of(t: float, engine: int, scheduler_stats: Any, iteration_stats: Any,
              host: tuple[float, float] | None = None) -> StepSample:
    """The StepSample of one vLLM stat-logger record (`shadow.realvllm.probe` says what each field
    is): from the step's iteration details when the engine logs them, else from its IterationStats
    alone (read by attribute, so a vLLM without some of them gives zeros); `host`: the engine's
    (run, wait) seconds read at `t` (`EngineSched.poll`)."""
    details = scheduler_stats.iteration_details
    tokens = iteration_stats.num_generation_tokens if iteration_stats is not None else 0
    preempted = iteration_stats.num_preempted_reqs if iteration_stats is not None else 0
    gaps = None if iteration_stats is None else getattr(iteration_stats, "inter_token_latencies_iter", None)
    period = min(gaps) if gaps else None
    run_wait = host if host is not None else (None, None)
    base = (t, engine, None if details is None else details.elapsed_ms / 1000.0,
            scheduler_stats.num_running_reqs, scheduler_stats.num_waiting_reqs,
            scheduler_stats.kv_cache_usage, tokens, preempted)
    if details is not None:
        return StepSample(*base, details.num_ctx_tokens, details.num_ctx_requests,
                          details.num_generation_requests, details.iteration_index,
                          bool(getattr(details, "is_dummy", False)), period, *run_wait)
    prompt = getattr(iteration_stats, "prompt_token_stats", None)
    computed = getattr(prompt, "computed", None)
    if computed is None:
        computed = getattr(iteration_stats, "num_prompt_tokens", 0)
    return StepSample(*base, int(computed or 0),
                      len(getattr(iteration_stats, "time_to_first_tokens_iter", None) or ()),
                      len(gaps or ()), engine_interval_s=period, run_s=run_wait[0], wait_s=run_wait[1])


@dataclass
class SenderCounts:
    """What happened to the offered steps (each step ends in exactly one of the first four)."""

    sent: int = 0
    dropped_full: int = 0  # the queue was full when the engine offered it
    dropped_failed: int = 0  # its batch could not be posted (connection, status, timeout)
    dropped_closed: int = 0  # still queued when the sender was closed
    posts: int = 0
    failed_posts: int = 0
    last_error: str = ""
    rejected: dict[str, int] = field(default_factory=dict)  # reasons the event API gave
    by_engine: dict[int, EngineCounts] = field(default_factory=dict)  # the four outcomes per engine

    def engine(self, index: int) -> EngineCounts:
        """The outcome counts of one engine (created at zero)."""
        c = self.by_engine.get(index)
        if c is None:
            c = self.by_engine[index] = EngineCounts()
        return c

    def add(self, outcome: str, samples: list[StepSample]) -> None:
        """Count `samples` under `outcome` (sent, dropped_failed, dropped_closed), in total and per engine."""
        setattr(self, outcome, getattr(self, outcome) + len(samples))
        for s in samples:
            c = self.engine(s.engine)
            setattr(c, outcome, getattr(c, outcome) + 1)


@dataclass
class EngineCounts:
    """What happened to one engine's offered steps."""

    sent: int = 0
    dropped_full: int = 0
    dropped_failed: int = 0
    dropped_closed: int = 0


LOOK_EVERY_S = 5.0  # an engine not found yet is looked for again at most this often


class EngineSched:
    """Linux's scheduler statistics of the engines of this API server: per engine (its descendant
    titled `VLLM::EngineCore`, `_DP<n>` for DP rank n), the seconds the main thread of the process
    that runs its forward pass has run on a CPU and has waited, runnable, for one
    (`/proc/<pid>/schedstat`). That process is the engine core's worker (its child titled
    `VLLM::Worker…`; of several, tensor-parallel ranks, the first started) where vLLM runs one — its
    CPU build always does (the MP executor: "OMP requires the MP executor") — else the engine core
    itself. The engine core's own main thread is no measure of the engine's work there: it waits for
    the worker's output in a spinning loop, runnable, so its run and wait are mostly that loop's
    (measured on a tiny model at 8 streams: the worker 0.87 core on a CPU and 0.13 waiting, the
    engine core 0.40 and 0.59).

    Two sides: `poll(engine)` reads an engine's statistics now through a file descriptor kept open
    (one `pread`, about a microsecond: cheap enough for every step on the API server's loop) and
    never looks for processes; `look(now)` (the sender thread, or `read`) finds the engines polled
    but not found yet by scanning /proc (at most every LOOK_EVERY_S) and opens their files. An engine
    that went away is dropped by the poll that fails and looked for again. `poll` must be called from
    one thread; `look` from one other (or the same). None where there is no /proc or no such process
    (another host)."""

    def __init__(self, root: int | None = None, proc: str = "/proc") -> None:
        self.root = os.getpid() if root is None else root
        self.proc = proc
        self._pids: dict[int, int] = {}
        self._fds: dict[int, int] = {}  # engine -> open schedstat file (set by look, dropped by poll)
        self._wanted: set[int] = set()  # engines polled without a file
        self._stale: list[int] = []  # files poll dropped, closed by the next look
        self._looked: float | None = None  # when the processes were last looked for

    def _find(self, now: float) -> None:
        if self._looked is not None and now - self._looked < LOOK_EVERY_S:
            return
        self._looked = now
        parent: dict[int, int] = {}
        try:
            names = os.listdir(self.proc)
        except OSError:
            return
        for d in names:
            if d.isdigit():
                try:
                    with open(f"{self.proc}/{d}/stat", encoding="ascii", errors="replace") as fh:
                        parent[int(d)] = int(fh.read().rsplit(")", 1)[1].split()[1])
                except (OSError, ValueError, IndexError):
                    continue
        children: dict[int, list[int]] = {}
        for c, pp in parent.items():
            children.setdefault(pp, []).append(c)
        todo, mine = [self.root], []
        while todo:
            kids = children.get(todo.pop(), [])
            mine += kids
            todo += kids
        titles = {pid: self._title(pid) for pid in mine}
        for pid, title in titles.items():
            if title == b"VLLM::EngineCore":
                if 0 in self._pids:
                    continue
                engine = 0
            elif title is not None and title.startswith(b"VLLM::EngineCore_DP") and title[19:].isdigit():
                engine = int(title[19:])
            else:
                continue
            workers = [c for c in sorted(children.get(pid, []))
                       if (titles.get(c) or b"").startswith(b"VLLM::Worker")]
            self._pids[engine] = workers[0] if workers else pid

    def _title(self, pid: int) -> bytes | None:
        try:
            with open(f"{self.proc}/{pid}/cmdline", "rb") as fh:
                return fh.read().split(b"\0", 1)[0].strip()
        except OSError:
            return None

    def pid(self, engine: int, now: float) -> int | None:
        """The process whose main thread is engine `engine`'s measure (None: not found)."""
        if engine not in self._pids:
            self._find(now)
        return self._pids.get(engine)

    def want(self, engines: Iterable[int]) -> None:
        """Look for `engines` from the next `look` on, before their first poll (the probe says so once
        the engines are up: a short burst of steps would otherwise all come before a look found them)."""
        self._wanted.update(engines)

    @property
    def wanting(self) -> bool:
        """Some engine is wanted and not found yet."""
        return bool(self._wanted)

    def look(self, now: float) -> None:
        """Open the statistics of the engines polled but not found yet (scanning /proc at most every
        LOOK_EVERY_S); close the files polls dropped."""
        while self._stale:
            with contextlib.suppress(OSError):
                os.close(self._stale.pop())
        for engine in sorted(self._wanted):
            if engine in self._fds:
                self._wanted.discard(engine)
                continue
            pid = self.pid(engine, now)
            if pid is None:
                continue
            try:
                fd = os.open(f"{self.proc}/{pid}/schedstat", os.O_RDONLY)
            except OSError:
                self._pids.pop(engine, None)
                continue
            self._fds[engine] = fd
            self._wanted.discard(engine)

    def poll(self, engine: int) -> tuple[float, float] | None:
        """(seconds on a CPU, seconds waiting for one) of engine `engine`'s measured thread now; None
        until `look` has found it (asked for here), or when it went away."""
        fd = self._fds.get(engine)
        if fd is None:
            self._wanted.add(engine)
            return None
        try:
            run, wait, _ = os.pread(fd, 128, 0).split()
            return int(run) / 1e9, int(wait) / 1e9
        except (OSError, ValueError):
            del self._fds[engine]
            self._pids.pop(engine, None)
            self._stale.append(fd)
            self._wanted.add(engine)
            return None

    def read(self, engine: int, now: float) -> tuple[float, float] | None:
        """`poll` after `look`: from one thread (a sampler), the engine found if needs be."""
        if engine not in self._fds:
            self._wanted.add(engine)
            self.look(now)
        return self.poll(engine)


def events_url(base: str) -> str:
    """`base` as the URL of the event API (`/v1/events` appended unless present)."""
    base = base.rstrip("/")
    return base if base.endswith("/v1/events") else base + "/v1/events"


class StepSender:
    """Bounded queue + daemon sender thread; `offer()` never blocks, `close()` flushes briefly."""

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        worker: str | None = None,
        max_queue: int = DEFAULT_QUEUE,
        batch: int = DEFAULT_BATCH,
        flush_s: float = DEFAULT_FLUSH_S,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        sleep: Callable[[float], None] = time.sleep,
        sched: EngineSched | None = None,
    ) -> None:
        if max_queue < 1 or batch < 1:
            raise ValueError("max_queue and batch must be at least 1")
        parts = urllib.parse.urlsplit(events_url(url))
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"probe URL must be http(s)://host[:port][/path], got {url!r}")
        self.url = events_url(url)
        self._parts = parts
        self._headers = {"Content-Type": "application/x-ndjson"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self.worker = worker
        self.max_queue = max_queue
        self.batch = batch
        self.flush_s = flush_s
        self.timeout_s = timeout_s
        self.counts = SenderCounts()
        self._sleep = sleep
        self._queue: deque[StepSample] = deque()
        self._last: dict[int, StepSample] = {}
        self.sched = sched  # read by the probe at each step; the sender thread finds the engines
        self._conn: http.client.HTTPConnection | None = None
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shadow-step-probe", daemon=True)
        self._thread.start()

    # -- the engine side ---------------------------------------------------------------------------
    def offer(self, sample: StepSample) -> bool:
        """Queue one step; False (and counted) when the queue is full. Never blocks."""
        q = self._queue
        if len(q) >= self.max_queue:
            self.counts.dropped_full += 1
            self.counts.engine(sample.engine).dropped_full += 1
            return False
        q.append(sample)
        return True

    # -- the sender thread -------------------------------------------------------------------------
    def worker_name(self, engine: int) -> str | None:
        """The configured worker name; `{engine}` in it is replaced by the engine index."""
        if self.worker is None:
            return None
        return self.worker.replace("{engine}", str(engine))

    def to_event(self, s: StepSample) -> dict[str, Any]:
        """The `step` event for one sample (uses and updates the engine's previous sample)."""
        prev = self._last.get(s.engine)
        self._last[s.engine] = s
        interval = s.t - prev.t if prev is not None and prev.running > 0 else None
        if s.elapsed_s is not None:
            duration, source = s.elapsed_s, SOURCE_ELAPSED
        else:
            duration, source = (interval if interval is not None else 0.0), SOURCE_INTERVAL
        ev: dict[str, Any] = {
            "type": "step", "t": s.t, "duration_s": max(0.0, min(duration, 3599.0)),
            "engine": s.engine, "running": s.running, "waiting": s.waiting,
            "kv_usage": min(1.0, max(0.0, s.kv_usage)), "tokens": s.tokens,
            "preemptions": s.preemptions, "source": source,
            "prefill_tokens": max(0, s.prefill_tokens), "prefill_requests": max(0, s.prefill_requests),
        }
        if s.decode_requests is not None:
            ev["decode_requests"] = max(0, s.decode_requests)
        if s.iteration is not None:
            ev["iteration"] = max(0, s.iteration)
        if s.dummy:
            ev["dummy"] = True
        if s.engine_interval_s is not None:
            ev["engine_interval_s"] = max(0.0, min(s.engine_interval_s, 3599.0))
        if s.run_s is not None and s.wait_s is not None:
            ev["engine_run_s"], ev["engine_wait_s"] = s.run_s, s.wait_s
        if interval is not None:
            ev["interval_s"] = max(0.0, interval)
        name = self.worker_name(s.engine)
        if name is not None:
            ev["worker"] = name
        return ev

    def _take(self) -> list[StepSample]:
        q, out = self._queue, list[StepSample]()
        while q and len(out) < self.batch:
            out.append(q.popleft())
        return out

    def _run(self) -> None:
        # One post per flush interval (or per full batch): at hundreds of steps a second, a post
        # per step would cost the engine's host more CPU than the steps' data is worth.
        while not self._closing.is_set():
            if self.sched is not None and self.sched.wanting:  # found before their first steps
                self.sched.look(time.monotonic())
            if self._queue:
                self.flush_once()
            if len(self._queue) < self.batch:
                self._sleep(self.flush_s)
        self._close_conn()

    def flush_once(self) -> int:
        """Post one batch from the queue; the number of events it held."""
        items = self._take()
        if not items:
            return 0
        if self.sched is not None:
            self.sched.look(time.monotonic())  # the engines the probe polled without finding them
        body = b"".join(orjson.dumps(self.to_event(s)) + b"\n" for s in items)
        if self._post(body):
            self.counts.add("sent", items)
        else:
            self.counts.add("dropped_failed", items)
            self._sleep(min(1.0, self.flush_s * 5))  # a failing API is not hammered
        return len(items)

    def _post(self, body: bytes) -> bool:
        self.counts.posts += 1
        try:
            conn = self._conn or self._connect()
            path = self._parts.path or "/"
            conn.request("POST", path, body=body, headers=self._headers)
            resp = conn.getresponse()
            data = resp.read(1 << 20)
            if resp.status != 200:
                raise OSError(f"event API answered {resp.status}: {data[:200]!r}")
            self._note_rejections(data)
            return True
        except (OSError, http.client.HTTPException) as exc:
            self.counts.failed_posts += 1
            self.counts.last_error = str(exc)[:300]
            self._close_conn()
            return False

    def _note_rejections(self, data: bytes) -> None:
        try:
            rejected = json.loads(data).get("rejected") or {}
        except (ValueError, AttributeError):
            return
        if isinstance(rejected, dict):
            for reason, n in rejected.items():
                if isinstance(n, int):
                    self.counts.rejected[str(reason)] = self.counts.rejected.get(str(reason), 0) + n

    def _connect(self) -> http.client.HTTPConnection:
        p = self._parts
        cls = http.client.HTTPSConnection if p.scheme == "https" else http.client.HTTPConnection
        self._conn = cls(p.hostname or "127.0.0.1", p.port, timeout=self.timeout_s)
        return self._conn

    def _close_conn(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop the thread after posting what is queued (for at most `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        while self._queue and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.01)
        self._closing.set()
        self._thread.join(max(0.0, deadline - time.monotonic()) + self.timeout_s)
        if self._queue:
            left = list(self._queue)
            self._queue.clear()
            self.counts.add("dropped_closed", left)


def sender_from_env(env: dict[str, str] | None = None) -> StepSender | None:
    """A StepSender configured by the SHADOW_PROBE_* variables, or None when no URL is set."""
    env = dict(os.environ) if env is None else env
    url = env.get(ENV_URL, "").strip()
    if not url:
        return None
    queue = int(env.get(ENV_QUEUE) or DEFAULT_QUEUE)
    flush_ms = float(env.get(ENV_FLUSH_MS) or DEFAULT_FLUSH_S * 1000)
    return StepSender(url, token=env.get(ENV_TOKEN) or None, worker=env.get(ENV_WORKER) or None,
                      max_queue=queue, flush_s=flush_ms / 1000, sched=EngineSched())

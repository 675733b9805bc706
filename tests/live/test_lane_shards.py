"""Lanes in shards (`shadow.live.shards`, `shadow serve --lane-shards N [--ray ADDRESS]`): the
policies' lanes spread over shards in this process, in processes and on a local Ray instance give
the report one process gives on the same events — every lane's figures, their windows, the
comparison against `actual`, agreement — with the measured clock changing under the lanes (engine
probe steps) and with rolling windows; only the decision times (perf_counter) and the host's load
average differ."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import os
import random
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from shadow.app.serve import ServeConfig
from shadow.contracts.events import Event, Step
from shadow.live.lanes import LiveLanes
from shadow.live.metrics import LiveCollector
from shadow.live.shards import LocalShards, ProcessShards, ShardedLanes, Shards, deal
from shadow.mirror.config import MirrorConfig
from tests.harness import ServeThread
from tests.live import test_serve_api as serve_api
from tests.live.sessions import session_events
from tests.replay.test_sweep_ray import _env, ray_head  # noqa: F401 (the local Ray instance, a fixture)
from tests.reportschema import check_report

POLICIES = ("jsq-bytes", "br0", "brh:survival", "bra")
G, B = 4, 8


def _probe(events: list[Event], workers: int) -> list[Event]:
    """`events` with an engine probe's steps on every worker (15 ms + 2 ms per running sequence,
    the count changing every 40 steps) over their span: the lanes' measured clock changes as
    the cost fit settles."""
    t0, t1 = events[0].t, events[-1].t
    out = list(events)
    k = 0
    t = t0
    while t < t1:
        n = 1 + (k // 40) % 8
        period = 0.015 + 0.002 * n
        t += period
        for g in range(workers):
            out.append(Step(t + 1e-5 * g, 0.8 * period, worker=f"d{g}", engine=0, source="probe", running=n,
                            interval_s=period, engine_interval_s=period, decode_requests=n,
                            prefill_requests=0, prefill_tokens=0))
        k += 1
    out.sort(key=lambda e: e.t)
    return out


def _settings(rolling: bool) -> dict[str, Any]:
    return dict(workers=[f"d{g}" for g in range(G)], slots=B, policies=POLICIES, lag_s=0.5, window_s=0.5,
                compare_window_s=2.0, rolling_s=2.0 if rolling else None)


def _drive(live: LiveLanes, events: list[Event], chunk: int = 97) -> None:
    """As the lanes' thread does: events in batches, each batch processed, the lanes advanced to
    the newest event time; then drained."""
    for i in range(0, len(events), chunk):
        for ev in events[i:i + chunk]:
            live.listener(ev)
        live.process_now()
        live.advance_to(live.driver.now)
    live.drain()


def _untimed(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _untimed(v) for k, v in x.items()
                if not k.startswith("decision_") and k != "host_load_average"}
    if isinstance(x, list):
        return [_untimed(v) for v in x]
    return x


def _one_process(events: list[Event], rolling: bool) -> dict[str, Any]:
    live = LiveLanes(**_settings(rolling))
    _drive(live, events)
    return live.report()


def _sharded(events: list[Event], rolling: bool, shards: int,
             runner: Callable[[list[dict[str, Any]]], Shards]) -> tuple[dict[str, Any], ShardedLanes]:
    sharded = ShardedLanes(_settings(rolling), shards, runner)
    try:
        _drive(sharded.live, events)
        return sharded.report(), sharded
    finally:
        sharded.close()


def _events() -> list[Event]:
    evs, _ = session_events(60, G, B, rho=1.1, seed=3)
    return _probe(evs, G)


@pytest.fixture(scope="module")
def events() -> list[Event]:
    return _events()


def _same(want: dict[str, Any], got: dict[str, Any]) -> None:
    assert list(got["lanes"]) == list(want["lanes"])
    for label in want["lanes"]:
        assert _untimed(got["lanes"][label]) == _untimed(want["lanes"][label]), label
    assert _untimed(got) == _untimed(want)


@pytest.mark.parametrize("rolling", [False, True])
@pytest.mark.parametrize("shards", [1, 3])
def test_shards_in_this_process_give_the_one_process_report(events: list[Event], shards: int,
                                                            rolling: bool) -> None:
    want = _one_process(events, rolling)
    assert want["step_model"]["cost"]["groups"], "the probe's steps gave no cost fit: the clock never changed"
    assert all(v["steps"] > 0 for v in want["lanes"].values())
    assert want["comparison"]["windows"] > 0
    if rolling:
        assert want["rolling"]["reseeds"] > 0
    got, sharded = _sharded(events, rolling, shards, LocalShards)
    assert sharded.sent > 0
    _same(want, got)
    check_report(want)  # both as the published schema says (the cost fit's groups, rolling or not)
    check_report(got)


def test_shards_in_processes_give_the_one_process_report(events: list[Event]) -> None:
    want = _one_process(events, False)
    got, _ = _sharded(events, False, 2, ProcessShards)
    _same(want, got)


def test_policies_are_dealt_round_robin_to_non_empty_shards() -> None:
    assert deal(["a", "b", "c"], 2) == [["a", "c"], ["b"]]
    assert deal(["a"], 3) == [["a"]]
    with pytest.raises(ValueError):
        deal(["a"], 0)


def test_serve_takes_ray_only_with_shards() -> None:
    tap = MirrorConfig(upstreams={"d0": "http://127.0.0.1:1"}, slots=4)
    with pytest.raises(ValueError, match="--lane-shards"):
        ServeConfig(tap=tap, lane_ray="127.0.0.1:6379").validate()
    with pytest.raises(ValueError, match="--lane-shards"):
        ServeConfig(tap=tap, lane_shards=-1).validate()


#: The sharded run on Ray, in a process of its own started with Ray's settings in its environment
#: (as an operator's `shadow serve --ray` is): prints the report without its timings, as JSON.
RAY_RUN = """
import json, sys
from shadow.app.serve import ray_shards
from tests.live.test_lane_shards import _events, _sharded, _untimed
got, _ = _sharded(_events(), True, 2, ray_shards(sys.argv[1]))
import ray
assert not ray.is_initialized()  # the session the shards started is shut down
print("REPORT " + json.dumps(_untimed(got)))
"""


@pytest.mark.integration
def test_shards_on_a_local_ray_instance_give_the_one_process_report(
    events: list[Event], ray_head: str  # noqa: F811
) -> None:
    pytest.importorskip("ray", reason="the `ray` extra is not installed (scripts/test.sh installs it)")
    want = json.loads(json.dumps(_untimed(_one_process(events, True))))
    root = Path(__file__).resolve().parents[2]
    env = {**_env(), "PYTHONPATH": os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, "-c", RAY_RUN, ray_head], cwd=root, capture_output=True, text=True,
                          timeout=280, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    got = json.loads(lines[-1][len("REPORT "):])
    _same(want, got)


def test_metrics_read_the_merged_report(events: list[Event]) -> None:
    """/metrics (`LiveCollector`) of a sharded service reads the merged report: every lane's series."""
    sharded = ShardedLanes(_settings(False), 2, LocalShards)
    try:
        _drive(sharded.live, events[: len(events) // 4])
        values = {v for m in LiveCollector(sharded).collect() for s in m.samples for v in s.labels.values()}
    finally:
        sharded.close()
    assert {"actual", "jsq-bytes", "br0", "brh-survival", "bra-survival"} <= values


def test_a_sharded_serve_gives_the_lanes_of_one_process_over_http() -> None:
    """`shadow serve --lane-shards 2` in process over real HTTP (shard processes, the lanes' own
    thread teeing its moves): /v1/report's lanes as one process's, /metrics with every lane."""
    events, _ = session_events(120, serve_api.G, serve_api.B, rho=1.0, token_every=4)
    one, _ = serve_api._run([events])
    with ServeThread(dataclasses.replace(serve_api._config(), lane_shards=2)) as s:
        api = s.ready["api"]
        asyncio.run(serve_api._post(api, [events]))
        two = httpx.get(api + "/v1/report", params={"drain": 1}, timeout=120).json()
        metrics = httpx.get(api + "/metrics", timeout=60).text
        schema = httpx.get(api + "/v1/report/schema", timeout=60)
    assert schema.headers["content-type"] == "application/schema+json"
    check_report(two, schema.json())
    assert list(two["lanes"]) == list(one["lanes"]) == ["actual", "jsq-bytes", "br0", "brh-survival"]
    for label, lane in one["lanes"].items():
        for key in ("avg_spread_tokens", "avg_imbalance_tokens", "steps", "requests_finished", "agreements"):
            assert two["lanes"][label][key] == lane[key], (label, key)
    assert two["comparison"]["lanes"].keys() == one["comparison"]["lanes"].keys()
    for label in one["lanes"]:
        assert f'shadow_lane_steps_total{{lane="{label}"}}' in metrics


def _drive_in(live: LiveLanes, events: list[Event], cuts: list[int]) -> None:
    """`_drive` with the batches cut at `cuts` (indices into `events`)."""
    bounds = [0, *sorted(set(cuts)), len(events)]
    for a, b in itertools.pairwise(bounds):
        for ev in events[a:b]:
            live.listener(ev)
        live.process_now()
        live.advance_to(live.driver.now)
    live.drain()


def _unstalled(x: Any) -> Any:
    """`_untimed` without the lanes' `lookahead_stalls` (how often a lane was asked to run past an end
    not known yet: it counts the calls, so it moves with how often the lanes are advanced)."""
    if isinstance(x, dict):
        return {k: _unstalled(v) for k, v in x.items() if k != "lookahead_stalls"}
    return x


def test_the_report_does_not_depend_on_how_the_events_were_batched(events: list[Event]) -> None:
    """The lanes observe at points of event time and run up to a clock change before making it, and
    a held step tried again at the same instant does not route again, so one event per batch,
    batches cut at random or batches far longer than the lanes' lag give the report of batches of 97
    (before, the fidelity's samples, the step windows and where the clock changed moved with the
    batches, and BRA counted each retry of a held step as a round of its holds)."""
    n = len(events)
    want = LiveLanes(**_settings(False))
    _drive(want, events)
    coarse = list(range(2000, n, 2000))  # ~8 s of events a batch; the lag is 0.5 s
    for cuts in (list(range(1, n)), random.Random(11).sample(range(1, n), 300), coarse):
        live = LiveLanes(**_settings(False))
        _drive_in(live, events, cuts)
        assert _unstalled(_untimed(live.report())) == _unstalled(_untimed(want.report())), len(cuts)

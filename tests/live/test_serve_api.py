"""`shadow serve` in process over real HTTP: /v1/report, /metrics names, two forwarders, overload."""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest

from shadow.app.serve import ServeConfig
from shadow.contracts.events import Event
from shadow.live import LiveLanes
from shadow.mirror.config import MirrorConfig
from shadow.mirror.emitter import Emitter
from tests.harness import ServeThread
from tests.live.sessions import session_events

CONTRACT = {
    "shadow_lane_steps_total",
    "shadow_lane_spread_tokens",
    "shadow_lane_spread_token_steps_total",
    "shadow_lane_imbalance_tokens",
    "shadow_lane_imbalance_token_steps_total",
    "shadow_lane_barrier_idle_ratio",
    "shadow_lane_throughput_tokens_per_second",
    "shadow_lane_tpot_seconds",
    "shadow_lane_requests_finished_total",
    "shadow_lane_lookahead_stalls_total",
    "shadow_lane_lag_seconds",
    "shadow_lane_agreements_total",
    "shadow_lane_decisions_total",
    "shadow_lane_worker_load_tokens",
    "shadow_lane_worker_active_requests",
    "shadow_lane_decision_duration_seconds",
    "shadow_step_model_a_seconds_per_token",
    "shadow_step_model_b_seconds",
    "shadow_step_model_r2",
    "shadow_step_model_samples",
    "shadow_step_duration_seconds",
    "shadow_fidelity_load_relative_error",
    "shadow_live_events_dropped_total",
}
G, B = 4, 16


def _config(lag: float = 3600.0) -> ServeConfig:
    workers = {f"d{i}": f"http://127.0.0.1:9/{i}" for i in range(G)}  # event-API fed: no taps
    # a whole session (minutes of event time from t=1000) is posted at once: the event-time bound
    # is opened wide here (a live feed's times stay within a minute of the receiver's clock)
    tap = MirrorConfig(upstreams={}, workers=workers, slots=B, scrape_interval_s=0, event_skew_s=1e12)
    # the lanes on the configured model: the same lanes however the events were batched
    return ServeConfig(tap=tap, lag_s=lag, lane_clock="configured")


async def _post(api: str, parts: list[list[Event]]) -> None:
    emitters = [Emitter(api, batch_size=200) for _ in parts]
    for em in emitters:
        em.start()
    for em, evs in zip(emitters, parts, strict=True):
        for ev in evs:
            em.emit(ev)
    for em in emitters:
        await em.aclose()
        assert em.sent > 0 and em.dropped == 0 and em.rejected == 0


def _run(parts: list[list[Event]]) -> tuple[dict, str]:  # type: ignore[type-arg]
    with ServeThread(_config()) as s:
        api = s.ready["api"]
        assert s.ready["taps"] == {}
        asyncio.run(_post(api, parts))
        report = httpx.get(api + "/v1/report", params={"drain": 1}, timeout=60).json()
        metrics = httpx.get(api + "/metrics", timeout=10).text
    return report, metrics


def test_two_forwarders_give_the_same_lanes_as_one_and_metrics_follow_the_contract() -> None:
    events, reqs = session_events(200, G, B, rho=1.0, token_every=4)
    one, metrics = _run([events])
    by_worker: list[list[Event]] = [[], []]
    owner = {rid: int(w[1:]) % 2 for rid, *_, w in reqs}
    for ev in events:  # two tap processes, each in front of two workers
        by_worker[owner[ev.request_id]].append(ev)  # type: ignore[attr-defined]
    two, _ = _run(by_worker)
    assert one["workers"] == two["workers"] == [f"d{i}" for i in range(G)] and one["slots"] == B
    assert one["events"]["processed"] == one["events"]["enqueued"] == len(events)
    assert set(one["lanes"]) == {"actual", "jsq-bytes", "br0", "brh-survival"}
    for label, lane in one["lanes"].items():
        assert lane["requests_finished"] == 200
        for key in ("avg_spread_tokens", "avg_imbalance_tokens", "steps", "requests_finished"):
            assert two["lanes"][label][key] == lane[key], (label, key)
    for key in ("a_s_per_token", "b_s", "r2", "samples"):
        assert key in one["step_model"]
    assert "load_rel_error" in one["fidelity"]
    exported = set(re.findall(r"^# TYPE (\S+) \S+", metrics, re.M))
    assert exported >= CONTRACT, CONTRACT - exported
    assert 'shadow_lane_worker_load_tokens{lane="br0",worker="d3"}' in metrics
    steps = re.search(r'^shadow_lane_steps_total\{lane="actual"\} (\S+)', metrics, re.M)
    assert steps is not None and float(steps.group(1)) == one["lanes"]["actual"]["steps"]


def test_overload_drops_and_counts_and_never_blocks_the_producer() -> None:
    live = LiveLanes(workers=["d0", "d1"], slots=4, queue_size=100)
    events, _ = session_events(100, 2, 4, token_every=1)
    for ev in events:  # the relay side: no thread consumes, the queue fills
        live.listener(ev)
    assert live.enqueued == 100 and live.dropped["queue_full"] == len(events) - 100
    assert len(live._queue) == 100  # bounded
    assert live.process_now() == 100 and live.processed == 100
    live._publish()
    assert live.report()["events"]["dropped"]["queue_full"] == len(events) - 100
    assert any("dropped" in w for w in live.report()["warnings"])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--worker", "d0=http://x", "--slots", "4", "--lag", "-1"], "--lag must be in"),
        (["--worker", "d0=http://x", "--slots", "4", "--policies", "brh:oracle"], "offline only"),
        (["--worker", "d0=http://x"], "give the decode slots"),
        (["--worker", "d0=http://x", "--slots", "4", "--step-source", "x"], "invalid choice"),
    ],
)
def test_serve_rejects_bad_configuration_with_one_line(argv: list[str], message: str, capsys) -> None:  # type: ignore[no-untyped-def]
    from shadow.commands.serve import main

    with pytest.raises(SystemExit) if "invalid choice" in message else _nullcontext():
        assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_yaml_and_environment_configure_serve_and_flags_win(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from shadow.commands.serve import config_from_args, resolve_args

    cfg = tmp_path / "serve.yaml"
    cfg.write_text("slots: 8\nlag: 5\npolicies: [br0, jsq]\nworker: {d0: 'http://a', d1: 'http://b'}\n")
    args = resolve_args({"config": str(cfg), "lag": 1.5}, {"SHADOW_SERVE_STEP_SOURCE": "sse"})
    c = config_from_args(args)
    assert c.tap.slots == 8 and c.lag_s == 1.5 and c.policies == ("br0", "jsq")
    assert c.step_source == "sse" and list(c.tap.workers) == ["d0", "d1"]
    cfg.write_text("slots: 8\nbogus: 1\n")
    with pytest.raises(ValueError, match="unknown option 'bogus'"):
        resolve_args({"config": str(cfg)}, {})


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None

"""Compact recordings: one line per request, header with every configured worker, gzip, rotation."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from shadow.contracts.events import Arrive, Finish, Route, Step, to_dict
from shadow.mirror.recording import CompactRecorder
from shadow.replay.experiment import ReplaySetup, run_replay
from shadow.traces import TraceError, load_trace
from tests.live.sessions import session_events

WORKERS = ["d0", "d1", "d2", "d3", "idle"]  # "idle" is configured but gets no traffic


def _record(path: Path, events, **kw) -> CompactRecorder:  # type: ignore[no-untyped-def]
    rec = CompactRecorder(str(path), workers=WORKERS, slots=16, **kw)
    for i, ev in enumerate(events):
        rec.write(ev)
        if i % 500 == 0:
            rec.flush()
            rec.write(Step(ev.t, 0.03, "d0"))
    rec.close()
    return rec


def test_compact_recording_replays_like_the_event_log_and_keeps_idle_workers(tmp_path: Path) -> None:
    events, _ = session_events(300, 4, 16, token_every=1)
    log = tmp_path / "events.ndjson"
    log.write_text("".join(json.dumps(to_dict(ev)) + "\n" for ev in events))
    compact = tmp_path / "session.ndjson"
    _record(compact, events)
    assert compact.stat().st_size * 20 < log.stat().st_size  # compact: not a line per token
    lines = [json.loads(x) for x in compact.read_text().splitlines()]
    assert lines[0] == {"type": "session", "version": 2, "workers": WORKERS, "slots": 16}  # no lanes: a tap
    assert sum(x["type"] == "request" for x in lines) == 300
    assert any(x["type"] == "steps" and x["worker"] == "d0" and x["n"] >= 1 for x in lines)
    setup = ReplaySetup(slots=16, policies=("jsq-bytes", "br0"))
    a = run_replay(load_trace(log), setup)
    b = run_replay(load_trace(compact), setup)
    assert a.config["workers"] == 4  # the event log only knows the workers it saw
    assert b.config["workers"] == 5 and b.config["worker_names"] == WORKERS
    for label in ("actual", "jsq-bytes", "br0"):
        assert b.results[label].finished == a.results[label].finished == 300
    # the starved worker is part of the fleet: the actual lane's spread counts it at zero load
    assert b.results["actual"].avg_spread_tokens > a.results["actual"].avg_spread_tokens
    with pytest.raises(ValueError, match="-G 4 does not match the recording's 5 workers"):
        run_replay(
            load_trace(compact), ReplaySetup(workers=4, workers_given=True, slots=16, policies=("br0",))
        )
    assert (
        run_replay(load_trace(compact), ReplaySetup(workers=5, workers_given=True, slots=16)).config[
            "workers"
        ]
        == 5
    )


def test_gzip_and_rotation(tmp_path: Path) -> None:
    events, _ = session_events(400, 4, 16, token_every=4)
    path = tmp_path / "s.ndjson.gz"
    rec = _record(path, events)
    with gzip.open(path, "rt") as fh:
        assert sum(1 for _ in fh) >= 401
    assert len(load_trace(path).requests) == 400 and rec.parts == 0
    rot = tmp_path / "r.ndjson"
    rec = _record(rot, events, max_bytes=8192)
    parts = sorted(tmp_path.glob("r.ndjson*"))
    assert rec.parts >= 2 and len(parts) == rec.parts + 1
    total = 0
    for part in parts:
        first = json.loads(part.read_text().splitlines()[0])
        assert first["type"] == "session" and first["workers"] == WORKERS  # each part stands alone
        assert part.stat().st_size < 8192 + 16384
        total += len(load_trace(part).requests)
    assert total == 400


def test_bad_records_are_one_line_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.ndjson"
    bad.write_text(
        '{"type":"session","version":1,"workers":["d0"],"slots":4}\n{"type":"request","request_id":"a"}\n'
    )
    with pytest.raises(TraceError, match=r"bad\.ndjson:2: invalid record: missing field 'arrival_t'"):
        load_trace(bad)
    bad.write_text(
        '{"type":"session","version":1,"workers":["d0"],"slots":4}\n'
        '{"type":"request","request_id":"a","arrival_t":1,"prompt_tokens":5,"output_tokens":3,"worker":"d9"}\n'
    )
    with pytest.raises(TraceError, match=r"workers \['d9'\] not in the header"):
        load_trace(bad)


def test_the_body_size_is_recorded_and_replayed_and_optional(tmp_path: Path) -> None:
    events = [Arrive("a", 0.0, prompt_tokens=50, body_bytes=900), Route("a", 0.1, "d0", 50),
              Finish("a", 1.0, "length", 4),
              Arrive("b", 0.2, prompt_tokens=60), Route("b", 0.3, "d1", 60), Finish("b", 1.2, "length", 4)]
    path = tmp_path / "session.ndjson"
    _record(path, events)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    sizes = {x["request_id"]: x.get("body_bytes") for x in lines if x["type"] == "request"}
    assert sizes == {"a": 900, "b": None}  # left out where the taps did not see it
    trace = load_trace(path)
    assert [(r.prompt_tokens, r.body_bytes) for r in trace.requests] == [(50, 900), (60, None)]
    bad = tmp_path / "bad.ndjson"
    bad.write_text('{"type":"session","version":2,"workers":["d0"],"slots":4}\n{"type":"request","request_id":"a",'
                   '"arrival_t":1,"prompt_tokens":5,"output_tokens":3,"worker":"d0","body_bytes":"9"}\n')
    with pytest.raises(TraceError, match="body_bytes must be an integer >= 0"):
        load_trace(bad)

"""Recorded sessions: events fold into requests (dropping incomplete ones) and replay with an actual lane."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shadow.cli import main
from shadow.contracts.events import Arrive, Cancel, Finish, Route, Step, Token, to_dict
from shadow.engine.feed import recorded_requests
from shadow.traces import TraceError, load_trace


def session() -> list:  # type: ignore[type-arg]
    return [
        Arrive("a", 10.0, prompt_tokens=100, prompt_key="k1"),
        Route("a", 10.1, "d1"),
        Token("a", 10.2, 1),
        Token("a", 10.3, 2),
        Token("a", 10.3, 2),  # duplicate
        Finish("a", 10.4, "stop", 3),
        Route("b", 11.0, "d0", prompt_tokens=50),  # no Arrive: arrival = route time
        Token("b", 11.5, 4),
        Token("b", 11.4, 3),  # out of order
        Cancel("b", 11.6),
        Arrive("c", 12.0, prompt_tokens=10),  # never ends
        Route("d", 12.5, "d1"),  # no prompt size
        Finish("d", 13.0, "stop", 5),
        Arrive("e", 13.0, prompt_tokens=7),
        Cancel("e", 13.1),  # cancelled before any token
        Step(13.2, 0.06, "d0"),
    ]


def test_events_fold_into_requests_and_incomplete_ones_are_counted() -> None:
    out = recorded_requests(session())
    assert [
        (r.request_id, r.arrival_s, r.prompt_tokens, r.output_tokens, r.worker) for r in out.requests
    ] == [
        ("a", 10.1, 100, 3, "d1"),  # reaches the decode router when placed
        ("b", 11.0, 50, 4, "d0"),
    ]
    assert out.requests[0].prompt_key == "k1"
    assert dict(out.dropped) == {"never_ended": 1, "no_prompt_tokens": 1, "no_tokens": 1}
    assert out.steps == [0.06]


def test_recorded_session_replays_with_an_actual_lane(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "session.ndjson"
    path.write_text("".join(json.dumps(to_dict(e)) + "\n" for e in session()))
    trace = load_trace(path)
    assert [r.worker for r in trace.requests] == ["d1", "d0"]
    assert "dropped" in trace.notes
    out = tmp_path / "r.json"
    assert main(["replay", str(path), "--policies", "jsq,br0", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert list(data["results"]) == ["actual", "jsq", "br0"]
    assert data["config"]["workers"] == 2
    assert data["config"]["worker_names"] == ["d0", "d1"]


def test_bad_event_line_is_a_one_line_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.ndjson"
    path.write_text(json.dumps(to_dict(Arrive("a", 1.0, 5))) + "\n" + '{"type": "route", "t": 1}\n')
    with pytest.raises(TraceError, match=r"bad.ndjson:2: invalid event"):
        load_trace(path)


def test_request_folder_event_by_event_gives_the_batch_fold_as_requests_end() -> None:
    from shadow.engine.feed import RequestFolder

    folder = RequestFolder()
    ends = []
    for ev in session():
        got = folder.apply(ev)
        if got is not None:
            rec, reason, t_end = got
            ends.append((rec.request_id if rec else None, reason, t_end))
            if rec is not None:
                assert rec in recorded_requests(session()).requests
    # a ends (stop), b is cancelled after tokens, d and e end but are dropped; c never ends
    assert ends == [("a", "stop", 10.4), ("b", "cancel", 11.6), (None, "stop", 13.0), (None, "cancel", 13.1)]
    assert dict(folder.dropped) == {"no_prompt_tokens": 1, "no_tokens": 1}
    assert folder.open() == 1


def test_request_folder_evicts_the_oldest_open_request_beyond_its_bound() -> None:
    from shadow.engine.feed import RequestFolder

    folder = RequestFolder(max_open=2)
    for i, rid in enumerate(("x1", "x2", "x3")):
        assert folder.apply(Arrive(rid, float(i), prompt_tokens=10)) is None
    assert folder.open() == 2 and folder.dropped["evicted"] == 1
    folder.apply(Token("x3", 3.0, 1))
    got = folder.apply(Finish("x3", 3.5, "length", 2))
    assert got is not None and got[0] is not None
    assert (got[0].request_id, got[0].prompt_tokens, got[0].output_tokens, got[1]) == ("x3", 10, 2, "length")
    # x1 was evicted: its end arrives without an arrival and is dropped as such, not invented
    got = folder.apply(Finish("x1", 4.0, "stop", 3))
    assert got == (None, "stop", 4.0) and folder.dropped["no_arrival"] == 1
    assert folder.open() == 1  # x2

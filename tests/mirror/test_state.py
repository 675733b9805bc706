"""Mirrored fleet state: idempotence, reordering, orphans, reaping, phantoms."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from shadow.contracts.events import Arrive, Cancel, Finish, Route, Step, Token
from shadow.mirror.state import DUPLICATE, LATE, MOVED, OK, ORPHAN, STALE, UNKNOWN_WORKER, MirrorState


def test_route_tokens_finish_keep_counts() -> None:
    s = MirrorState(["d0", "d1"], slots=4)
    assert s.apply(Arrive("a", 0.0, 10), 0.0) == OK
    assert s.apply(Route("a", 0.1, "d0", 10), 0.1) == OK
    assert s.apply(Token("a", 0.2, 3), 0.2) == OK
    snap = s.snapshot(0.3)
    assert snap["workers"]["d0"] == {
        "active": 1,
        "kv_tokens": 13,
        "finished": 0,
        "cancelled": 0,
        "reaped": 0,
        "slots": 4,
        "free_slots": 3,
    }
    assert s.apply(Finish("a", 0.4, "stop", 5), 0.4) == OK
    snap = s.snapshot(0.5)
    assert snap["workers"]["d0"]["active"] == 0 and snap["workers"]["d0"]["kv_tokens"] == 0
    assert snap["workers"]["d0"]["finished"] == 1 and snap["phantoms"] == 0


def test_duplicates_and_backwards_tokens_are_ignored() -> None:
    s = MirrorState(["d0"])
    s.apply(Route("a", 0, "d0", 4), 0)
    assert s.apply(Route("a", 0, "d0", 4), 0) == DUPLICATE
    s.apply(Token("a", 1, 5), 1)
    assert s.apply(Token("a", 1, 5), 1) == DUPLICATE
    assert s.apply(Token("a", 1, 2), 1) == STALE
    assert s.workers["d0"].kv_tokens == 9
    s.apply(Cancel("a", 2), 2)
    assert s.apply(Finish("a", 2, "abort"), 2) == DUPLICATE
    assert s.apply(Token("a", 3, 9), 3) == DUPLICATE
    assert s.workers["d0"].cancelled == 1 and s.workers["d0"].finished == 0 and s.active() == 0


def test_token_before_route_is_kept_then_attached() -> None:
    s = MirrorState(["d0"])
    assert s.apply(Token("a", 0, 3), 0) == ORPHAN
    assert s.active() == 0 and s.pending() == 1
    assert s.apply(Route("a", 0, "d0", 10), 0) == OK
    assert s.workers["d0"].active == 1 and s.workers["d0"].kv_tokens == 13


def test_finish_before_route_counts_finished_and_never_activates() -> None:
    s = MirrorState(["d0"])
    assert s.apply(Finish("a", 0, "stop", 2), 0) == ORPHAN
    assert s.apply(Route("a", 0, "d0", 10), 0) == LATE
    assert s.active() == 0 and s.workers["d0"].finished == 1 and s.orphans == 1


def test_unknown_worker_is_dropped_unless_dynamic() -> None:
    s = MirrorState(["d0"])
    assert s.apply(Route("a", 0, "zz", 1), 0) == UNKNOWN_WORKER
    assert s.active() == 0
    d = MirrorState(dynamic_workers=True)
    assert d.apply(Route("a", 0, "zz", 1), 0) == OK and d.active("zz") == 1


def test_reroute_moves_the_request() -> None:
    s = MirrorState(["d0", "d1"])
    s.apply(Route("a", 0, "d0", 10), 0)
    s.apply(Token("a", 0, 2), 0)
    assert s.apply(Route("a", 1, "d1"), 1) == MOVED
    assert s.active("d0") == 0 and s.active("d1") == 1 and s.workers["d1"].kv_tokens == 12


def test_route_update_adds_prompt_tokens_once() -> None:
    s = MirrorState(["d0"])
    s.apply(Route("a", 0, "d0"), 0)
    s.apply(Token("a", 0, 2), 0)
    assert s.apply(Route("a", 0, "d0", 30), 0) == DUPLICATE
    assert s.workers["d0"].kv_tokens == 32


def test_reaping_and_phantoms() -> None:
    s = MirrorState(["d0"], ttl_s=10, phantom_age_s=5)
    s.apply(Route("a", 0, "d0", 1), 0)
    s.apply(Route("b", 0, "d0", 1), 0)
    s.apply(Token("b", 4, 1), 4)
    s.apply(Step(4, 0.05, "d0"), 4)
    assert s.phantoms(6) == 1  # a silent for 6 s
    assert s.reap(9) == []
    out = s.reap(10.5)
    assert [f.request_id for f in out] == ["a"] and out[0].reason == "reaped"
    assert s.reap(20)[0].request_id == "b"
    assert s.active() == 0 and s.workers["d0"].reaped == 2 and s.phantoms(100) == 0


def test_tombstones_are_bounded() -> None:
    s = MirrorState(["d0"], tombstones=10)
    for i in range(100):
        s.apply(Route(f"r{i}", 0, "d0"), 0)
        s.apply(Finish(f"r{i}", 0), 0)
    assert len(s._tomb) == 10 and s.active() == 0


# -- property: any interleaving of (duplicated, reordered, truncated) streams ends at zero -------------


@st.composite
def _streams(draw: st.DrawFn) -> tuple[list, list[str]]:
    n = draw(st.integers(1, 12))
    events = []
    ids = [f"r{i}" for i in range(n)]
    for rid in ids:
        w = draw(st.sampled_from(["d0", "d1", "d2", "nope"]))
        seq = [
            Arrive(rid, 0.0, draw(st.integers(0, 50))),
            Route(rid, 0.0, w, draw(st.none() | st.integers(0, 50))),
        ]
        for g in sorted(draw(st.lists(st.integers(0, 40), max_size=6))):
            seq.append(Token(rid, 0.0, g))
        end = draw(st.sampled_from(["finish", "cancel", "none"]))
        if end == "finish":
            seq.append(Finish(rid, 0.0, "stop", draw(st.none() | st.integers(0, 40))))
        elif end == "cancel":
            seq.append(Cancel(rid, 0.0))
        cut = draw(st.integers(0, len(seq)))  # truncation
        seq = seq[:cut] if draw(st.booleans()) else seq
        dups = draw(st.lists(st.sampled_from(seq), max_size=3)) if seq else []
        events.extend(seq + dups)
    perm = draw(st.permutations(range(len(events))))
    return [events[i] for i in perm], ids


@settings(max_examples=200, deadline=None)
@given(_streams())
def test_any_event_soup_leaves_no_active_request_after_every_stream_ends(
    data: tuple[list, list[str]],
) -> None:
    events, ids = data
    s = MirrorState(["d0", "d1", "d2"], ttl_s=5.0, phantom_age_s=2.0)
    for ev in events:
        s.apply(ev, 0.0)
        for wc in s.workers.values():
            assert wc.active >= 0 and wc.kv_tokens >= 0
    assert sum(s.outcomes.values()) == len(events)
    # every stream ends (the tap always produces an end) -> nothing stays active
    for rid in ids:
        s.apply(Finish(rid, 1.0, "stop"), 1.0)
    assert s.active() == 0 and all(wc.kv_tokens == 0 for wc in s.workers.values())
    assert s.phantoms(100.0) == 0
    # and anything not ended by an event is reaped
    s2 = MirrorState(["d0", "d1", "d2"], ttl_s=5.0)
    for ev in events:
        s2.apply(ev, 0.0)
    s2.reap(10.0)
    assert s2.live() == 0 and s2.active() == 0 and s2.phantoms(100.0) == 0


def test_tombstones_are_forgotten_after_their_ttl_and_capped() -> None:
    from shadow.contracts.events import Arrive, Finish, Route
    from shadow.mirror.state import DUPLICATE, MirrorState

    st = MirrorState(["d0"], ttl_s=10.0, tombstones=1000)
    for i in range(50):
        st.apply(Arrive(f"r{i}", 0.0, 5), float(i))
        st.apply(Route(f"r{i}", 0.0, "d0"), float(i))
        st.apply(Finish(f"r{i}", 0.0, "stop", 3), float(i))
    assert st.apply(Finish("r49", 0.0, "stop", 3), 49.5) == DUPLICATE  # remembered within the TTL
    st.reap(55.0)  # forgets requests that ended before t = 45
    assert len(st._tomb) == 5 and "r45" in st._tomb and "r44" not in st._tomb
    assert st.workers["d0"].finished == 50 and st.live() == 0
    capped = MirrorState(["d0"], ttl_s=1e9, tombstones=10)
    for i in range(30):
        capped.apply(Arrive(f"q{i}", 0.0, 5), 0.0)
        capped.apply(Finish(f"q{i}", 0.0, "stop", 1), 0.0)
    assert len(capped._tomb) == 10

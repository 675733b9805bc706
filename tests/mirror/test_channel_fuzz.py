"""The channel's decoders against random and adversarial bytes, both sides: what an analysis reads
from a relay (`ChannelReader.feed`), what a relay reads from an analysis (its control frames:
`FrameReader(CONTROL_MAX)` then `Relay._control`) and the relay's first read of a connection (the
handshake's opening). Whatever comes, only the declared error escapes (`FrameError`;
`HandshakeError` for the handshake), and the memory a call takes at its peak (tracemalloc) is
bounded by a constant plus a multiple of the bytes it was given and holds: a length claimed in a
header is never allocated before it arrives, a marshal header claiming 2^31-1 items is garbage
like any other, JSON nests at most 1024 deep.

The decoders' time is linear in their input (a header's length check, orjson, field checks); it
is measured nowhere here (no wall-clock limits in tests)."""

from __future__ import annotations

import struct
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shadow.contracts import frames as f
from shadow.contracts import handshake
from shadow.contracts.frames import FrameError, FrameReader
from shadow.dataplane.relay import Relay, RelaySockets, RelaySpec
from shadow.mirror.channel_reader import ChannelReader

PER_BYTE = 64  # peak bytes a decoder may take per byte it holds (Python objects from JSON: ~30)
SLACK = 256 << 10  # and a constant (an exception, a traceback, the first frames' interned names)
HELLO = f.encode(f.T_HELLO, {"relay_id": "r1", "boot_id": "b", "taps": [{"name": "d0", "role": "decode"}],
                         "v": handshake.VERSION, "mono": 1.0, "max_body": 4 << 20})

_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner, max_size=6),
    max_leaves=40,
)
_KINDS = [f.T_INFO, f.T_DATA, f.T_START, f.T_END, f.T_MARK, f.T_CTL, f.T_HELLO]
_kinds = st.sampled_from(_KINDS) | st.integers(0, 255)
_times = st.floats(allow_nan=True, allow_infinity=True)


def _frame(kind: int, body: bytes) -> bytes:
    return f.HDR.pack(kind, len(body)) + body


def _meta_body(meta: bytes, raw: bytes = b"", claimed: int | None = None) -> bytes:
    return struct.pack("<I", len(meta) if claimed is None else claimed) + meta + raw


@st.composite
def _shaped(draw: st.DrawFn) -> bytes:
    """A rare frame of the right kind and nearly the right shape: the list or object its decoder
    expects, with any values in it."""
    kind = draw(st.sampled_from([f.T_INFO, f.T_MARK, f.T_HELLO, f.T_CTL]))
    n = {f.T_INFO: 11, f.T_CTL: 2}.get(kind)
    meta: Any
    if n is None:
        keys = ["token", "offered", "dropped", "snapshot", "notice", "taps", "pending_bytes", "relay_id",
                "pid", "boot_id", "group", "v", "mono", "max_body"]
        meta = draw(st.dictionaries(st.sampled_from(keys), _json, max_size=10))
    else:
        meta = draw(st.lists(_json, min_size=n - 1, max_size=n + 1))
        if kind == f.T_CTL and meta:
            meta[0] = draw(st.sampled_from(["hello", "sync", "ack", "other"]))
    raw = draw(st.binary(max_size=64))
    return _frame(kind, _meta_body(orjson.dumps(meta), raw))


@st.composite
def _adversarial(draw: st.DrawFn) -> bytes:
    """Frames built to cost: huge claimed lengths, marshal headers claiming 2^31-1 items, deep or
    wide JSON, a JSON length past the frame, data frames too short for their fields, odd times."""
    choice = draw(st.integers(0, 8))
    if choice == 0:  # a header claiming up to 4 GiB, and a little of it
        return f.HDR.pack(draw(_kinds), draw(st.integers(0, (1 << 32) - 1))) + draw(st.binary(max_size=32))
    if choice == 1:  # protocol 1's 10-byte bombs, back to back
        bomb = draw(st.sampled_from([b"[", b"(", b"{", b"<", b">"])) + b"\xff\xff\xff\x7f"
        return _frame(draw(_kinds), bomb) * draw(st.integers(1, 50))
    if choice == 2:  # JSON nested deeper than orjson's limit
        depth = draw(st.integers(500, 3000))
        return _frame(draw(_kinds), _meta_body(b"[" * depth + b"]" * depth))
    if choice == 3:  # wide JSON: many small containers
        item = draw(st.sampled_from([b"[]", b"{}", b"0", b'""', b"null"]))
        wide = b"[" + b",".join([item] * draw(st.integers(1, 5000))) + b"]"
        return _frame(draw(_kinds), _meta_body(wide))
    if choice == 4:  # a JSON length past the end of its frame
        return _frame(draw(_kinds), _meta_body(b"{}", claimed=draw(st.integers(3, (1 << 32) - 1))))
    if choice == 5:  # struct-packed frames (data, start, end) of any length and content
        kind = draw(st.sampled_from([f.T_DATA, f.T_START, f.T_END]))
        return _frame(kind, draw(st.binary(max_size=40)))
    if choice == 6:
        return f.DATA.pack(f.T_DATA, f.DATA_FIXED + 3, draw(st.integers(0, (1 << 32) - 1)),
                         draw(st.integers(0, (1 << 32) - 1)), draw(_times)) + b"abc"
    if choice == 7:
        return f.START.pack(f.T_START, f.START_LEN, draw(st.integers(0, (1 << 32) - 1)), draw(_times))
    return _frame(draw(_kinds), _meta_body(orjson.dumps(draw(_json)), draw(st.binary(max_size=32))))


_frames = st.one_of(st.binary(min_size=1, max_size=200), _shaped(), _adversarial())


@st.composite
def _stream(draw: st.DrawFn) -> list[bytes]:
    """Frames (after a valid hello, or not), concatenated and cut into chunks at random points."""
    frames = draw(st.lists(_frames, min_size=1, max_size=12))
    data = (HELLO if draw(st.booleans()) else b"") + b"".join(frames)
    cuts = sorted(draw(st.lists(st.integers(0, len(data)), max_size=6)))
    return [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]


@contextmanager
def _peak_within(held: int) -> Iterator[None]:
    """The block's peak traced memory stays within PER_BYTE × `held` + SLACK."""
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    yield
    peak = tracemalloc.get_traced_memory()[1] - base
    assert peak <= PER_BYTE * held + SLACK, f"a peak of {peak} bytes for {held} bytes held"


@pytest.fixture
def traced() -> Iterator[None]:
    tracemalloc.start()
    try:
        yield
    finally:
        tracemalloc.stop()


# 60 streams of 1-12 frames per test (~130 adversarial frames, ~14 of each kind). Under tracemalloc a
# stream costs up to ~1 s of CPU on a loaded 2-core host (200 examples took 150-170 s at load 15,
# near pytest's 300 s timeout, which then surfaced as a hypothesis FlakyStrategyDefinition).
_FUZZ = settings(max_examples=60, deadline=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def _only_declared(call: Callable[[], Any], *declared: type[Exception]) -> bool:
    """True when `call` raised one of `declared` (anything else propagates)."""
    try:
        call()
    except declared:
        return True
    return False


@_FUZZ
@given(chunks=_stream())
def test_the_analysis_reader_raises_only_frame_errors_within_bounded_memory(
    chunks: list[bytes], traced: None
) -> None:
    reader = ChannelReader(boot_id="b", oldest_s=30.0)
    for chunk in chunks:
        held = reader._frames.pending + len(chunk)
        with _peak_within(held):
            failed = _only_declared(lambda chunk=chunk: reader.feed(chunk), FrameError)
        if failed:  # (the owner closes the connection; a fresh stream follows)
            assert reader._frames.pending == 0


def _relay() -> Relay:
    spec = RelaySpec(taps=[{"name": "d0", "upstream": "http://127.0.0.1:9", "role": "decode"}])
    return Relay(spec, RelaySockets(taps={}, attach=[]))


@pytest.fixture(scope="module")
def relay() -> Relay:
    return _relay()


@_FUZZ
@given(chunks=_stream())
def test_the_relay_control_path_raises_only_frame_errors_within_bounded_memory(
    chunks: list[bytes], relay: Relay, traced: None
) -> None:
    frames = FrameReader(f.CONTROL_MAX)

    def control(chunk: bytes) -> None:
        for kind, body in frames.feed(chunk):
            relay._control("a", kind, body)

    for chunk in chunks:
        held = frames.pending + len(chunk)
        with _peak_within(held):
            if _only_declared(lambda chunk=chunk: control(chunk), FrameError):
                frames = FrameReader(f.CONTROL_MAX)  # (the relay detaches that analysis)


@_FUZZ
@given(opening=st.binary(min_size=handshake.OPEN, max_size=handshake.OPEN) | _frames.map(
    lambda b: (b + bytes(handshake.OPEN))[: handshake.OPEN]))
def test_the_relays_first_read_raises_only_handshake_errors(opening: bytes) -> None:
    try:
        reply, expected = handshake.answer(b"key", opening)
    except handshake.HandshakeError as exc:
        assert exc.reason in handshake.REFUSALS
        return
    assert opening[: handshake.HEAD] == handshake.head()  # only a true opening gets an answer
    assert len(reply) == handshake.HEAD + handshake.ANSWER and len(expected) == handshake.MAC


def test_the_bombs_of_the_issue_are_refused_as_soon_as_their_header_is_read() -> None:
    """A frame claiming more than the bound is refused from its header alone; protocol 1's marshal
    bombs are an unknown layout to the analysis, and not a control frame to the relay."""
    reader = ChannelReader()
    with pytest.raises(FrameError, match="over the bound"):
        reader.feed(f.HDR.pack(f.T_INFO, 1 << 30))
    for bomb in (b"[\xff\xff\xff\x7f", b"(\xff\xff\xff\x7f"):
        with pytest.raises(FrameError):
            ChannelReader().feed(_frame(f.T_CTL, bomb))
        with pytest.raises(FrameError):
            _relay()._control("a", f.T_CTL, bomb)

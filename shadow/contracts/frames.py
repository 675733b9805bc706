"""The attach channel's frames: their layout, how a byte stream is split into them, and how each
kind is decoded — at a cost bounded for any input.

Frame: `<B kind><I length><body>`. `FrameReader` checks `length` against its bound before it holds
a byte of the body (the relay reads an analysis's frames up to `CONTROL_MAX`; an analysis reads a
relay's up to `frame_bound(max_body)`, its largest legitimate info frame).

Data frames, the hot path, are struct-packed: T_DATA `<IId>` cid, seq, t + the payload (one read
of the upstream's socket: at most 256 KiB under asyncio and uvloop); T_START `<Id>` cid, t; and
so is a request's end, T_END (`End`).

The rare frames — T_HELLO, T_INFO, T_MARK (relay → analysis) and T_CTL (analysis → relay) —
carry `<I n>`, n bytes of JSON (at most `META_MAX`), then a raw segment (an info frame's request
body; empty otherwise). JSON is decoded by orjson: time linear in the input, memory proportional
to it, nesting at most 1024 deep; then each kind's typed decoder checks every field (types,
ranges, string lengths, closed sets of names) and builds what the caller reads. Strings longer
than `FIELD_MAX` are refused; the relay clamps its own (`clamp`, counted by the caller).

Anything malformed raises `FrameError` (a `ValueError`) and nothing else: its owner closes the
connection and counts it.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Collection
from typing import Any, NamedTuple, TypeVar

import orjson

from shadow.contracts.tapwire import CUT_REASONS, END_REASONS, REJECT_REASONS

T_INFO, T_DATA, T_START, T_END, T_MARK, T_CTL, T_HELLO = 1, 2, 3, 4, 5, 6, 7
HDR = struct.Struct("<BI")
DATA = struct.Struct("<BIIId")  # type, length, cid, seq, t   (length counts cid + seq + t + payload)
DATA_FIXED = DATA.size - HDR.size
DATA_BODY = struct.Struct("<IId")  # a data frame's body before its payload: cid, seq, t
START = struct.Struct("<BIId")  # type, length, cid, t
START_LEN = START.size - HDR.size
_START_BODY = struct.Struct("<Id")
_META_LEN = struct.Struct("<I")

FIELD_MAX = 8 << 10  # characters of any string in a rare frame
META_MAX = 1 << 20  # bytes of a rare frame's JSON
CONTROL_MAX = 64 << 10  # bytes of a frame from an analysis (the relay's bound)
MAX_TAPS = 1024  # taps a hello or a mark may name
MAX_NAME = 128  # characters of the name an analysis attaches under
_U32 = (1 << 32) - 1
_I64 = (1 << 63) - 1
ROLES = ("decode", "prefill", "front")

DEFAULT_MAX_BODY = 4 << 20  # request body bytes a relay copies (`shadow tap --max-body`'s default)


def frame_bound(max_body: int) -> int:
    """The largest frame a relay copying request bodies up to `max_body` bytes sends: an info
    frame with such a body and the most JSON (data frames are smaller: META_MAX covers one read)."""
    return HDR.size + _META_LEN.size + META_MAX + max_body


class FrameError(ValueError):
    """A malformed channel frame (or stream): the connection it came on is closed and counted."""


class Incompatible(FrameError):
    """A well-formed frame this side cannot take as configured (the relay copies larger bodies
    than this analysis reads): trying again cannot help; the message names the fix."""


# -- splitting --------------------------------------------------------------------------------------


class FrameReader:
    """Splits a byte stream into (kind, body) frames; a frame longer than `max_frame` raises
    FrameError as soon as its header is read (nothing of it is kept)."""

    def __init__(self, max_frame: int) -> None:
        self._buf = bytearray()
        self.max_frame = max_frame

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        buf = self.add(data)
        out: list[tuple[int, bytes]] = []
        pos = 0
        while (at := self.next(pos)) is not None:
            kind, body, pos = at
            out.append((kind, bytes(buf[body:pos])))
        del buf[:pos]
        return out

    @property
    def pending(self) -> int:
        """Bytes of an incomplete frame held."""
        return len(self._buf)

    def add(self, data: bytes) -> bytearray:
        """Append `data`; the buffer the frames are read from (`next`), until `del buf[:pos]`."""
        buf = self._buf
        buf += data
        return buf

    def next(self, pos: int) -> tuple[int, int, int] | None:
        """(kind, body start, body end) of the complete frame at `pos` of the buffer, or None."""
        buf = self._buf
        if len(buf) - pos < HDR.size:
            return None
        kind, length = HDR.unpack_from(buf, pos)
        if length > self.max_frame:
            del buf[:]
            raise FrameError(f"a frame of {length} bytes, over the bound of {self.max_frame}")
        body = pos + HDR.size
        if len(buf) - body < length:
            return None
        return kind, body, body + length


# -- encoding (what this side sends) ------------------------------------------------------------------


def encode(kind: int, meta: Any, raw: bytes = b"") -> bytes:
    """A rare frame: `meta` as JSON, then `raw`."""
    j = orjson.dumps(meta)
    return HDR.pack(kind, _META_LEN.size + len(j) + len(raw)) + _META_LEN.pack(len(j)) + j + raw


def clamp(s: str) -> str:
    """`s` cut to FIELD_MAX characters (what a relay does to a string it sends)."""
    return s if len(s) <= FIELD_MAX else s[:FIELD_MAX]


# -- decoding: the JSON and its fields ------------------------------------------------------------


def _meta(body: bytes) -> tuple[Any, bytes]:
    """A rare frame's JSON (decoded) and raw segment."""
    n = int.from_bytes(body[:4], "little")
    end = 4 + n
    if len(body) < 4 or n > META_MAX or end > len(body):
        raise FrameError(f"a frame's JSON of {n} bytes in {len(body)}")
    try:
        meta = orjson.loads(body[4:end])
    except orjson.JSONDecodeError as exc:
        raise FrameError(f"a frame's JSON: {exc}") from None
    return meta, body[end:]


def _int(v: Any, hi: int = _I64, lo: int = 0) -> int:
    if type(v) is not int or not lo <= v <= hi:
        raise FrameError(f"expected an integer in [{lo}, {hi}], got {_show(v)}")
    return v


def _float(v: Any) -> float:
    if type(v) is float or type(v) is int:  # (JSON has no NaN or infinities)
        return float(v)
    raise FrameError(f"expected a number, got {_show(v)}")


def _str(v: Any, n: int = FIELD_MAX) -> str:
    if type(v) is not str or len(v) > n:
        raise FrameError(f"expected a string of at most {n} characters, got {_show(v)}")
    return v


def _opt_str(v: Any) -> str | None:
    return None if v is None else _str(v)


def _one_of(v: Any, names: Collection[str]) -> str:
    if type(v) is not str or v not in names:
        raise FrameError(f"expected one of {', '.join(names)}, got {_show(v)}")
    return v


def _list(v: Any, n: int, fields: int | None = None) -> list[Any]:
    if type(v) is not list or len(v) > n or (fields is not None and len(v) != fields):
        raise FrameError(f"expected a list of {fields if fields is not None else f'at most {n}'} items, "
                         f"got {_show(v)}")
    return v


def _dict(v: Any, n: int = 64) -> dict[str, Any]:
    if type(v) is not dict or len(v) > n:
        raise FrameError(f"expected an object of at most {n} names, got {_show(v)}")
    return v


def _show(v: Any) -> str:
    """What a bad field was, in a few words (never its content: it may be request data)."""
    if isinstance(v, str | list | dict):
        return f"a {type(v).__name__} of {len(v)}"
    return type(v).__name__ if not isinstance(v, int | float) or isinstance(v, bool) else repr(v)


V = TypeVar("V")


def _known(v: Any, names: Collection[str], value: Callable[[Any], V]) -> dict[str, V]:
    """An object of counters by name: names not in `names` are ignored (a newer peer's), every
    value checked."""
    return {k: value(x) for k, x in _dict(v, len(names) + 64).items() if k in names}


# -- decoding: each kind ----------------------------------------------------------------------------


class Info(NamedTuple):
    """A request's head as the relay saw it (T_INFO)."""

    cid: int
    tap: str
    method: str
    path: str
    request_id: str | None
    body: bytes | None
    body_len: int
    t_start: float
    status: int  # 0: not yet answered
    resp_headers: dict[str, str]
    traceparent: str | None


def encode_info(info: Info) -> bytes:
    """An info frame (strings clamped by the caller: see `clamp`)."""
    meta = [info.cid, info.tap, info.method, info.path, info.request_id, info.body is not None, info.body_len,
            info.t_start, info.status, info.resp_headers, info.traceparent]
    return encode(T_INFO, meta, info.body or b"")


def decode_info(body: bytes) -> Info:
    """(Every field checked in one expression first: a frame per request; the checks one by one,
    naming what is wrong, only when that fails.)"""
    meta, raw = _meta(body)
    if type(meta) is list and len(meta) == 11:
        cid, tap, method, path, rid, has_body, blen, t0, status, rh, tp = meta
        if (type(cid) is int and 0 <= cid <= _U32 and type(tap) is str and len(tap) <= FIELD_MAX
                and type(method) is str and len(method) <= FIELD_MAX and type(path) is str
                and len(path) <= FIELD_MAX and (rid is None or (type(rid) is str and len(rid) <= FIELD_MAX))
                and (has_body is True or (has_body is False and not raw)) and type(blen) is int
                and 0 <= blen <= _I64 and type(t0) is float and type(status) is int and 0 <= status <= 999
                and (tp is None or (type(tp) is str and len(tp) <= FIELD_MAX)) and type(rh) is dict
                and len(rh) <= 16 and all(len(k) <= FIELD_MAX and type(v) is str and len(v) <= FIELD_MAX
                                          for k, v in rh.items())):
            return Info(cid, tap, method, path, rid, raw if has_body else None, blen, t0, status, rh, tp)
    cid, tap, method, path, rid, has_body, blen, t0, status, rh, tp = _list(meta, 11, 11)
    if type(has_body) is not bool or (not has_body and raw):
        raise FrameError("an info frame's body flag does not match its body")
    headers = {_str(k): _str(v) for k, v in _dict(rh, 16).items()}
    return Info(_int(cid, _U32), _str(tap), _str(method), _str(path), _opt_str(rid),
                raw if has_body else None, _int(blen), _float(t0), _int(status, 999), headers, _opt_str(tp))


class End(NamedTuple):
    """A request's end (T_END): its reason, last seq and number in the relay's order of ends.
    Struct-packed: `<IdBIQ` cid, t, reason (its index in END_REASONS), seq, end number."""

    cid: int
    t: float
    reason: str
    seq: int
    end_no: int


_END = struct.Struct("<BIIdBIQ")
_END_BODY = struct.Struct("<IdBIQ")


def encode_end(cid: int, t: float, reason: str, seq: int, end_no: int) -> bytes:
    return _END.pack(T_END, _END_BODY.size, cid, t, END_REASONS.index(reason), seq, end_no)


def decode_end(body: bytes) -> End:
    if len(body) != _END_BODY.size:
        raise FrameError(f"an end frame of {len(body)} bytes")
    cid, t, reason, seq, end_no = _END_BODY.unpack(body)
    if reason >= len(END_REASONS):
        raise FrameError(f"an end of unknown reason {reason}")
    return End(cid, t, END_REASONS[reason], seq, end_no)


def decode_start(body: bytes) -> tuple[int, float]:
    """(cid, t) of a T_START frame."""
    if len(body) != _START_BODY.size:
        raise FrameError(f"a start frame of {len(body)} bytes")
    cid, t = _START_BODY.unpack(body)
    return cid, t


def data_ok(length: int) -> None:
    """A T_DATA frame's length holds its fixed fields."""
    if length < DATA_FIXED:
        raise FrameError(f"a data frame of {length} bytes")


def _tap_info(v: Any) -> dict[str, str]:
    d = _dict(v, 16)
    return {"name": _str(d.get("name")), "upstream": _str(d.get("upstream", "")),
            "url": _str(d.get("url", "")), "role": _one_of(d.get("role", "decode"), ROLES)}


def decode_hello(body: bytes) -> dict[str, Any]:
    """The relay's hello: who it is, its taps, its clock, the largest body it copies."""
    h = _dict(_meta(body)[0])
    return {
        "relay_id": _str(h.get("relay_id"), 64),
        "pid": _int(h.get("pid", 0), _U32),
        "boot_id": _str(h.get("boot_id", ""), 64),
        "group": _str(h.get("group", "")),
        "taps": [_tap_info(t) for t in _list(h.get("taps", []), MAX_TAPS)],
        "v": _int(h.get("v"), _U32),
        "mono": _float(h.get("mono")),
        "max_body": _int(h.get("max_body"), _I64),
    }


def _tap_stats(v: Any) -> dict[str, Any]:
    d = _dict(v, 16)
    out: dict[str, Any] = {k: _int(d[k]) for k in ("requests", "connect_errors", "connections", "inflight")
                           if k in d}
    out["rejected"] = _known(d.get("rejected", {}), REJECT_REASONS, _int)
    out["cut"] = _known(d.get("cut", {}), CUT_REASONS, _int)
    return out


_SNAPSHOT = ("requests", "live", "unkept", "missed")


def decode_mark(body: bytes) -> dict[str, Any]:
    """A mark: `token`, `offered`, `dropped`, and optionally a `snapshot` (its counts), a `notice`
    (draining, replaced) and the relay's counters (`taps`, `pending_bytes`)."""
    m = _dict(_meta(body)[0])
    out: dict[str, Any] = {"token": _int(m.get("token")), "offered": _int(m.get("offered")),
                           "dropped": _int(m.get("dropped"))}
    if "snapshot" in m:
        out["snapshot"] = _known(m["snapshot"], _SNAPSHOT, _int)
    if "notice" in m:
        n = _dict(m["notice"], 8)
        notice: dict[str, Any] = {k: n[k] for k in ("draining", "replaced") if type(n.get(k)) is bool}
        if "relay_id" in n:
            notice["relay_id"] = _str(n["relay_id"], 64)
        out["notice"] = notice
    if "taps" in m:
        out["taps"] = {_str(k): _tap_stats(v) for k, v in _dict(m["taps"], MAX_TAPS).items()}
    if "pending_bytes" in m:
        out["pending_bytes"] = _int(m["pending_bytes"])
    return out


# -- control frames (analysis → relay) -------------------------------------------------------------


class Hello(NamedTuple):
    """An analysis's hello, after the handshake: the name it attaches under, where it was."""

    name: str
    relay_id: str
    end_seen: int


def encode_control(cmd: str, arg: Any) -> bytes:
    return encode(T_CTL, [cmd, arg])


def encode_hello(hello: Hello) -> bytes:
    return encode_control("hello", {"name": hello.name, "resume": {"relay_id": hello.relay_id,
                                                                   "end_seen": hello.end_seen}})


def decode_control(kind: int, body: bytes) -> tuple[str, Any]:
    """("hello", Hello) | ("sync", token) | ("ack", end number)."""
    if kind != T_CTL:
        raise FrameError(f"a frame of kind {kind} from an analysis")
    cmd, arg = _list(_meta(body)[0], 2, 2)
    if cmd == "hello":
        h = _dict(arg, 8)
        resume = _dict(h.get("resume", {}), 8)
        return "hello", Hello(_str(h.get("name", ""), MAX_NAME), _str(resume.get("relay_id", ""), 64),
                              _int(resume.get("end_seen", 0)))
    if cmd in ("sync", "ack"):
        return cmd, _int(arg)
    raise FrameError(f"an unknown control command ({_show(cmd)})")

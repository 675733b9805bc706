"""A client whose bytes came while the tap's loop was stalled never meets a 408 (issue t408).

Seen: `openai.APIStatusError: 408 shadow tap: request head not received in time` in
tests/active/test_mode_flips.py at load 14-18 on 2 cores. A head or body deadline ran after a
loop stall before the bytes that had come during it were read: uvloop (libuv) runs timers due
after an iteration's I/O callbacks before it polls again, so bytes sent during a stall inside an
I/O callback were still unread when the deadline ran; under asyncio a callback the stall left
queued could send them just before the deadline ran. The loop is stalled here by a blocking call
inside an I/O callback of the tap's own loop (what starvation does to it), with a deadline far
shorter than the stall; no test timing is asserted. The hostile-peer side holds: a peer that
sends nothing more is still answered 408 after such a stall.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable
from typing import Any

import pytest

from shadow.base.front import STALL_S
from shadow.base.runtime import loop_runner
from shadow.dataplane.dropqueue import DropQueue
from shadow.dataplane.http1 import TapLimits
from shadow.dataplane.tap import Tap
from tests.mirror.h11_upstream import H11Server, Recorder, recording_app

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

DEADLINE_S = 0.2  # the tap's header/body deadline here: far shorter than every stall below
HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 2\r\n"
# (kind of deadline, bytes sent before the stall, bytes sent after it)
SPLITS = {
    "header": (HEAD, b"\r\n{}"),
    "body": (HEAD + b"\r\n", b"{}"),
}
LOOPS = ("asyncio", "uvloop")


async def _until(pred: Callable[[], bool]) -> None:
    """Yield to the loop until `pred()` holds (a condition, not a timer; the test's timeout bounds it)."""
    while not pred():
        await asyncio.sleep(0.001)


def _stall(loop: asyncio.AbstractEventLoop, seconds: float, then: Callable[[], Any]) -> None:
    """Block `loop` for `seconds` inside one of its I/O callbacks (as a starved or busy loop is),
    then call `then()` from that callback."""
    a, b = socket.socketpair()

    def stalled() -> None:
        loop.remove_reader(a.fileno())
        a.recv(1)
        time.sleep(seconds)  # the stall itself: nothing else runs on the loop meanwhile
        then()
        a.close()
        b.close()

    loop.add_reader(a.fileno(), stalled)
    b.send(b"x")


async def _recv_all(loop: asyncio.AbstractEventLoop, s: socket.socket) -> bytes:
    out = b""
    while chunk := await loop.sock_recv(s, 1 << 16):
        out += chunk
    return out


def _run(
    loop_kind: str, kind: str, stall_s: float, late_send: bool, send_rest: bool, paused: bool = False
) -> tuple[bytes, dict[str, int]]:
    """A tap in front of an h11 upstream; a client sends SPLITS[kind][0], the tap arms its `kind`
    deadline, the loop stalls `stall_s` and the rest comes during the stall (`late_send` False:
    unread when the stall ends) or just after it (True: from a callback the stall left queued), or
    never (`send_rest` False). `paused`: the tap stopped reading the connection (as when the
    upstream takes no more) from before the stall until the rest is sent. Returns what the client
    read until the close and the refusals."""
    first, rest = SPLITS[kind]
    got: dict[str, Any] = {}
    with H11Server(recording_app(Recorder())) as up:

        async def go() -> None:
            loop = asyncio.get_running_loop()
            tap = Tap("s", up.url, DropQueue(1 << 10), limits=TapLimits(header_timeout_s=DEADLINE_S))
            await tap.start()
            s = socket.create_connection(("127.0.0.1", tap.port))
            s.setblocking(False)
            try:
                s.send(first)
                await _until(lambda: any(c._timer_kind == kind for c in tap._clients))
                (conn,) = tap._clients
                if paused:
                    conn._pause("buffer")

                def send_rest_now() -> None:
                    conn._resume("buffer")
                    if send_rest:
                        s.send(rest)

                then = (lambda: loop.call_soon(send_rest_now)) if late_send else send_rest_now
                _stall(loop, stall_s, then)
                got["out"] = await _recv_all(loop, s)
                got["rejected"] = dict(tap.rejected)
            finally:
                s.close()
                await tap.close()

        loop_runner(loop_kind)(go())
    return got["out"], got["rejected"]


@pytest.mark.parametrize("loop_kind", LOOPS)
@pytest.mark.parametrize("kind", sorted(SPLITS))
def test_bytes_that_came_during_a_stall_are_read_before_the_deadline_is_judged(
    loop_kind: str, kind: str
) -> None:
    """The rest of the request is in the socket when the stall (longer than the deadline, shorter
    than STALL_S past it) ends: it is read, the request is answered 200 (before: 408 under uvloop)."""
    out, rejected = _run(loop_kind, kind, DEADLINE_S + STALL_S / 2, late_send=False, send_rest=True)
    assert out.startswith(b"HTTP/1.1 200 "), out[:200]
    assert rejected[f"{kind}_timeout"] == 0, rejected


@pytest.mark.parametrize("loop_kind", LOOPS)
@pytest.mark.parametrize("kind", sorted(SPLITS))
def test_a_deadline_the_loop_ran_late_gives_the_client_the_time_it_lost(loop_kind: str, kind: str) -> None:
    """The loop stalls more than STALL_S past the deadline and the rest comes only after the stall
    (a client starved as long as the tap): the deadline moves by the time lost, the request is
    answered 200 (before: 408 under both loops)."""
    out, rejected = _run(loop_kind, kind, DEADLINE_S + STALL_S * 1.5, late_send=True, send_rest=True)
    assert out.startswith(b"HTTP/1.1 200 "), out[:200]
    assert rejected[f"{kind}_timeout"] == 0, rejected


@pytest.mark.parametrize("loop_kind", LOOPS)
@pytest.mark.parametrize("kind", sorted(SPLITS))
def test_a_peer_that_sends_nothing_more_still_gets_its_408_after_a_stall(loop_kind: str, kind: str) -> None:
    """The hostile-peer protection holds: after the stall (and the time it gave back) a peer that
    sent nothing more is answered 408 and closed, counted under its deadline's kind."""
    out, rejected = _run(loop_kind, kind, DEADLINE_S + STALL_S * 1.5, late_send=True, send_rest=False)
    assert out.startswith(b"HTTP/1.1 408 "), out[:200]
    assert (b"request head " if kind == "header" else b"request body ") in out, out
    assert rejected[f"{kind}_timeout"] == 1, rejected


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_a_body_deadline_never_runs_out_while_the_tap_is_not_reading(loop_kind: str) -> None:
    """The tap paused reading (its buffer towards the upstream is full) past the body deadline, by
    less than STALL_S: the client is not the one silent, so the deadline waits again; once reading
    resumes the body comes and the request is answered 200 (before: 408 under uvloop)."""
    out, rejected = _run(loop_kind, "body", DEADLINE_S * 2, late_send=True, send_rest=True, paused=True)
    assert out.startswith(b"HTTP/1.1 200 "), out[:200]
    assert rejected["body_timeout"] == 0, rejected

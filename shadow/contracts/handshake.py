"""Mutual authentication of an attach connection, before either side reads a frame of the other's.

    analysis → relay   OPEN    MAGIC VERSION 0      + nonce_a                  8 + 32 bytes
    relay → analysis   ANSWER  MAGIC VERSION status + nonce_r + mac_r          8 + 64 bytes (status OK)
    analysis → relay   PROOF   mac_a                                           32 bytes

    mac_r = HMAC-SHA256(key, "shadow-attach relay"    + nonce_a + nonce_r)
    mac_a = HMAC-SHA256(key, "shadow-attach analysis" + nonce_a + nonce_r)

Each side proves it holds the key over both sides' fresh nonces (a recorded exchange does not
replay), under a label of its own (one side's proof is never the other's: no reflection). The
analysis checks mac_r before it sends anything more, so whoever listens at its address gets
OPEN — a version and a random nonce — and nothing else: no token, no name. The relay checks mac_a
(`hmac.compare_digest`) before it reads a frame. The key is the attach token over TCP, empty over
the unix socket, where the peer's uid is checked instead (`check_peer`: ours, or root; the relay
checks once it has read OPEN, the analysis before it sends it). Every read is exact-length, under
the caller's deadline.

A relay that will not go on answers its 8-byte head with a status instead (BUSY: too many
connections in the handshake, or draining — try again; PEER: this uid is not let in) and closes.
A relay of another VERSION answers its own head and closes: the analysis names both versions and
the fix. A relay from before the handshake (protocol 1) closes at once: it reads OPEN as a frame
over its 64 KiB bound. An analysis from before it is answered with the one frame it can read that
names the fix (`legacy_refusal`), then the connection is closed.

Anything wrong raises `HandshakeError` (a `ValueError`) with a `reason` (the relay counts its
refusals by it) and a one-line message.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import secrets
import socket
import struct

MAGIC = b"SHAT"
VERSION = 2  # protocol 1: no handshake, marshal frames
_HEAD = struct.Struct("<4sHH")  # magic, version, status
HEAD = _HEAD.size
NONCE = 32
MAC = 32
OPEN = HEAD + NONCE
ANSWER = NONCE + MAC  # after the head
OK, BUSY, PEER = 0, 1, 2
_RELAY = b"shadow-attach relay"
_ANALYSIS = b"shadow-attach analysis"
LEGACY_CTL = 6  # the first byte of a protocol-1 analysis's hello (its frame kind)
#: what the relay counts a refused connection under (shadow_tap_attach_refused_total's reasons)
REFUSALS = ("busy", "timeout", "closed", "magic", "protocol", "proof", "peer", "hello", "full", "draining")
RELOAD = "`shadow tap --reload` the group (and restart the analysis) with the installed version"


class HandshakeError(ValueError):
    """The handshake failed: `reason` (on the relay's side one of REFUSALS; on the analysis's also
    "unanswered": the relay closed without a byte), a one-line message; `final` when trying again
    cannot help (a version mismatch); `reply`: what the relay sends before it closes."""

    def __init__(self, reason: str, message: str, *, final: bool = False, reply: bytes = b"") -> None:
        super().__init__(message)
        self.reason = reason
        self.final = final
        self.reply = reply


def _mac(key: bytes, label: bytes, nonce_a: bytes, nonce_r: bytes) -> bytes:
    return hmac.new(key, label + nonce_a + nonce_r, hashlib.sha256).digest()


def head(status: int = OK) -> bytes:
    return _HEAD.pack(MAGIC, VERSION, status)


def _read_head(data: bytes, who: str) -> int:
    """The status in a peer's head (HandshakeError when it is not this protocol's)."""
    magic, version, status = _HEAD.unpack(data)
    if magic != MAGIC:
        if who == "analysis" and data[0] == LEGACY_CTL:
            raise HandshakeError("protocol", "an analysis of attach protocol 1 (an older shadow): " + RELOAD,
                                 reply=legacy_refusal())
        raise HandshakeError("magic", f"the {who} did not open the attach handshake (not a shadow {who}?)")
    if version != VERSION:
        raise HandshakeError("protocol", f"the {who} speaks attach protocol {version}, this one {VERSION}: "
                             + RELOAD, final=True, reply=head())
    return int(status)


def legacy_refusal() -> bytes:
    """The one frame an analysis of protocol 1 reads: its kind of hello (encoded in its format,
    marshal — encoded here, never decoded) naming one tap, called after the fix; that analysis
    refuses a relay serving a tap it is not configured for, quoting the name, and stops."""
    import marshal

    name = f"<this relay speaks attach protocol {VERSION}: {RELOAD}>"
    body = marshal.dumps({"relay_id": "", "taps": [{"name": name, "role": "decode"}]})
    return struct.pack("<BI", 7, len(body)) + body


# -- sans-IO steps -------------------------------------------------------------------------------------


def opening() -> tuple[bytes, bytes]:
    """The analysis's OPEN and its nonce."""
    nonce = secrets.token_bytes(NONCE)
    return head() + nonce, nonce


def answer(key: bytes, open_msg: bytes) -> tuple[bytes, bytes]:
    """The relay's ANSWER to OPEN, and the proof it then expects."""
    _read_head(open_msg[:HEAD], "analysis")
    nonce_a, nonce_r = open_msg[HEAD:OPEN], secrets.token_bytes(NONCE)
    return head() + nonce_r + _mac(key, _RELAY, nonce_a, nonce_r), _mac(key, _ANALYSIS, nonce_a, nonce_r)


def answer_status(data: bytes) -> None:
    """The relay's head says go on (HandshakeError otherwise)."""
    status = _read_head(data, "relay")
    if status == BUSY:
        raise HandshakeError("busy", "the relay is busy (too many connections in the handshake, or draining)")
    if status == PEER:
        raise HandshakeError("peer", f"the relay does not let uid {os.geteuid()} attach: run the analysis as "
                             "the tap group's user (or root)")
    if status != OK:
        raise HandshakeError("protocol", f"the relay answered status {status}")


def prove(key: bytes, nonce_a: bytes, rest: bytes) -> bytes:
    """The analysis's PROOF, once the relay's has been checked (HandshakeError when it is wrong)."""
    nonce_r, mac_r = rest[:NONCE], rest[NONCE:]
    if not hmac.compare_digest(mac_r, _mac(key, _RELAY, nonce_a, nonce_r)):
        raise HandshakeError("proof", "the relay's handshake does not prove the attach token (a wrong "
                             "--attach-token, or not this tap group's relay): nothing was sent to it")
    return _mac(key, _ANALYSIS, nonce_a, nonce_r)


def check_proof(expected: bytes, proof: bytes) -> None:
    if not hmac.compare_digest(expected, proof):
        raise HandshakeError("proof", "the analysis's handshake does not prove the attach token")


# -- the peer on a unix socket ------------------------------------------------------------------------


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a connected unix socket (SO_PEERCRED)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[1])


def check_peer(sock: socket.socket, who: str) -> None:
    """The peer of a unix socket runs as this process's user, or root (HandshakeError otherwise)."""
    uid = peer_uid(sock)
    if uid not in (os.geteuid(), 0):
        raise HandshakeError("peer", f"the {who} at the other end of the unix socket runs as uid {uid}, not "
                             f"this user ({os.geteuid()}) nor root: refused")


# -- both sides, on a loop ----------------------------------------------------------------------------


async def recv_exact(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int, what: str, silent: str = "closed"
) -> bytes:
    """Exactly `n` bytes (HandshakeError "closed" when the peer closes or resets the connection
    first; `silent` when it does before a byte). Its caller's deadline bounds the wait."""
    buf = bytearray()
    while len(buf) < n:
        try:
            data = await loop.sock_recv(sock, n - len(buf))
        except OSError as exc:  # (a reset before a byte is as silent as a close)
            raise HandshakeError("closed" if buf else silent,
                                 f"the connection failed {what}: {exc.strerror or exc}") from None
        if not data:
            raise HandshakeError("closed" if buf else silent,
                                 f"the peer closed the connection {what} ({len(buf)} of {n} bytes)")
        buf += data
    return bytes(buf)


async def client(loop: asyncio.AbstractEventLoop, sock: socket.socket, key: bytes) -> None:
    """The analysis's side: OPEN, check the relay's ANSWER, PROOF."""
    msg, nonce_a = opening()
    await loop.sock_sendall(sock, msg)
    try:
        got = await recv_exact(loop, sock, HEAD, "before the relay's handshake", silent="unanswered")
    except HandshakeError as exc:
        if exc.reason != "unanswered":
            raise
        raise HandshakeError("unanswered", "the relay closed the connection without answering the handshake, "
                             f"as one of attach protocol 1 (an older shadow) does: {RELOAD}") from None
    answer_status(got)
    rest = await recv_exact(loop, sock, ANSWER, "in the handshake")
    await loop.sock_sendall(sock, prove(key, nonce_a, rest))


async def server(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, key: bytes, unix: bool = False
) -> None:
    """The relay's side: read OPEN (its head checked before its nonce is waited for), check the
    peer's uid when `unix` (refused: PEER), ANSWER, check the PROOF."""
    got = await recv_exact(loop, sock, HEAD, "in the handshake")
    _read_head(got, "analysis")
    got += await recv_exact(loop, sock, NONCE, "in the handshake")
    if unix:
        try:
            check_peer(sock, "analysis")
        except HandshakeError as exc:
            exc.reply = head(PEER)
            raise
    reply, expected = answer(key, got)
    await loop.sock_sendall(sock, reply)
    check_proof(expected, await recv_exact(loop, sock, MAC, "in the handshake"))

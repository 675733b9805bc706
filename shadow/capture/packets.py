"""Reading TCP segments off an interface without being in the path: an AF_PACKET socket (needs
CAP_NET_RAW), a classic BPF program in the kernel keeping only TCP to or from the given ports, and
IPv4/TCP headers parsed here (only what reassembly needs; anything malformed is counted and skipped).

`PacketSocket(interface, ports)`: `recv()` returns one `Segment` or None (a packet that was not
one of ours, a duplicate of loopback's outgoing copy, or malformed); `stats()` reads the kernel's
own counters (packets seen, dropped because this reader was too slow).
"""

from __future__ import annotations

import ctypes
import errno
import socket
import struct
import time
from dataclasses import dataclass

ETH_P_ALL = 0x0003
SOL_PACKET = 263
PACKET_STATISTICS = 6
PACKET_OUTGOING = 4
SO_ATTACH_FILTER = 26
SO_RCVBUFFORCE = 33
IFF_LOOPBACK = 0x8
SIOCGIFFLAGS = 0x8913
FIN, SYN, RST = 0x01, 0x02, 0x04
_IP = struct.Struct("!BBHHHBBH4s4s")
_TCP = struct.Struct("!HHIIBB")


@dataclass(frozen=True, slots=True)
class Segment:
    """One TCP segment: addresses as (dotted ip, port), sequence number, flags, payload, arrival."""

    src: tuple[str, int]
    dst: tuple[str, int]
    seq: int
    flags: int
    payload: bytes
    t: float


class _SockFilter(ctypes.Structure):
    _fields_ = [
        ("code", ctypes.c_uint16),
        ("jt", ctypes.c_uint8),
        ("jf", ctypes.c_uint8),
        ("k", ctypes.c_uint32),
    ]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(_SockFilter))]


# classic BPF opcodes used below
_LDB_ABS, _LDH_ABS, _LDH_IND, _LDXB_MSH = 0x30, 0x28, 0x48, 0xB1
_JEQ_K, _JSET_K, _AND_K, _RET_K = 0x15, 0x45, 0x54, 0x06


def bpf_program(ports: list[int]) -> list[tuple[int, int, int, int]]:
    """Keep IPv4 TCP segments (unfragmented or first fragments) whose source or destination port
    is in `ports`; the packet starts at its IP header (a SOCK_DGRAM packet socket)."""
    if not 1 <= len(ports) <= 100:
        raise ValueError("between 1 and 100 ports")
    prog: list[tuple[int, int, int, int]] = [
        (_LDB_ABS, 0, 0, 0),  # A = first byte
        (_AND_K, 0, 0, 0xF0),
        (_JEQ_K, 0, 0, 0x40),  # IPv4? (patched: jf -> drop)
        (_LDB_ABS, 0, 0, 9),  # protocol
        (_JEQ_K, 0, 0, 6),  # TCP? (patched)
        (_LDH_ABS, 0, 0, 6),  # flags + fragment offset
        (_JSET_K, 0, 0, 0x1FFF),  # a later fragment: drop (patched: jt -> drop)
        (_LDXB_MSH, 0, 0, 0),  # X = IP header length
        (_LDH_IND, 0, 0, 0),  # source port
    ]
    src_checks = len(prog)
    prog += [(_JEQ_K, 0, 0, p) for p in ports]
    prog.append((_LDH_IND, 0, 0, 2))  # destination port
    dst_checks = len(prog)
    prog += [(_JEQ_K, 0, 0, p) for p in ports]
    keep = len(prog)
    prog.append((_RET_K, 0, 0, 0x40000))  # keep (up to 256 KiB)
    drop = len(prog)
    prog.append((_RET_K, 0, 0, 0))

    def jump(at: int, to: int) -> int:
        return to - at - 1

    out = [list(i) for i in prog]  # (code, jt, jf, k): jt taken when the test holds
    out[2][2] = jump(2, drop)  # not IPv4
    out[4][2] = jump(4, drop)  # not TCP
    out[6][1] = jump(6, drop)  # a later fragment
    for i in range(src_checks, src_checks + len(ports)):
        out[i][1] = jump(i, keep)  # a matching source port: keep; else the next check
    for i in range(dst_checks, dst_checks + len(ports)):
        out[i][1] = jump(i, keep)
    out[dst_checks + len(ports) - 1][2] = jump(dst_checks + len(ports) - 1, drop)
    for ins in out:
        if ins[1] > 255 or ins[2] > 255:
            raise ValueError("BPF jump too long")
    return [(a, b, c, d) for a, b, c, d in out]


def _attach_bpf(sock: socket.socket, prog: list[tuple[int, int, int, int]]) -> None:
    arr = (_SockFilter * len(prog))(*[_SockFilter(c, jt, jf, k) for c, jt, jf, k in prog])
    fprog = _SockFprog(len(prog), ctypes.cast(arr, ctypes.POINTER(_SockFilter)))
    sock.setsockopt(
        socket.SOL_SOCKET,
        SO_ATTACH_FILTER,
        bytes(ctypes.string_at(ctypes.addressof(fprog), ctypes.sizeof(fprog))),
    )


def _is_loopback(interface: str) -> bool:
    import fcntl

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sH14s", interface.encode()[:15], 0, b"")
        try:
            res = fcntl.ioctl(s.fileno(), SIOCGIFFLAGS, req)
        except OSError as exc:
            raise OSError(exc.errno, f"interface {interface!r}: {exc.strerror}") from None
    return bool(struct.unpack_from("16sH", res)[1] & IFF_LOOPBACK)


class PacketSocket:
    """See module docstring. OSError (naming what is needed) when the socket cannot be opened."""

    def __init__(self, interface: str, ports: list[int], rcvbuf: int = 64 << 20) -> None:
        self.interface = interface
        self.loopback = _is_loopback(interface)
        try:
            # protocol 0: a packet socket made with ETH_P_ALL receives from every interface at
            # once, unfiltered, until its filter is attached; with 0 it receives nothing until the
            # bind below (interface and ETH_P_ALL), by then filtered
            sock = socket.socket(socket.AF_PACKET, socket.SOCK_DGRAM, 0)
        except PermissionError:
            raise PermissionError(
                errno.EPERM,
                "a packet socket needs root or CAP_NET_RAW: run shadow capture "
                "as root, or grant it with setcap cap_net_raw+ep",
            ) from None
        try:
            _attach_bpf(sock, bpf_program(sorted(set(ports))))  # before bind: nothing unfiltered queues
            for opt in (SO_RCVBUFFORCE, socket.SO_RCVBUF):
                try:
                    sock.setsockopt(socket.SOL_SOCKET, opt, rcvbuf)
                    break
                except OSError:
                    continue
            sock.bind((interface, ETH_P_ALL))  # (Python swaps the byte order itself here)
        except OSError:
            sock.close()
            raise
        sock.settimeout(0.2)
        self.sock = sock
        self.malformed = 0
        self.duplicates = 0

    def recv(self) -> Segment | None:
        """The next segment (blocks up to 0.2 s; None on timeout or a packet to skip)."""
        try:
            data, addr = self.sock.recvfrom(1 << 18)
        except TimeoutError:
            return None
        t = time.monotonic()
        if addr[2] == PACKET_OUTGOING and self.loopback:
            self.duplicates += 1  # loopback delivers every packet a second time, incoming
            return None
        return self.parse(data, t)

    def parse(self, data: bytes, t: float) -> Segment | None:
        if len(data) < 20:
            self.malformed += 1
            return None
        vihl, _, total, _, frag, _, proto, _, src, dst = _IP.unpack_from(data)
        ihl = (vihl & 0x0F) * 4
        if vihl >> 4 != 4 or proto != 6 or ihl < 20 or total > len(data) or total < ihl + 20 or frag & 0x1FFF:
            self.malformed += 1
            return None
        sport, dport, seq, _, off, flags = _TCP.unpack_from(data, ihl)
        doff = (off >> 4) * 4
        if doff < 20 or ihl + doff > total:
            self.malformed += 1
            return None
        return Segment(
            (socket.inet_ntoa(src), sport),
            (socket.inet_ntoa(dst), dport),
            seq,
            flags,
            data[ihl + doff : total],
            t,
        )

    def stats(self) -> tuple[int, int]:
        """(packets, drops) the kernel counted since the last call (it resets them)."""
        raw = self.sock.getsockopt(SOL_PACKET, PACKET_STATISTICS, 8)
        packets, drops = struct.unpack("II", raw)
        return packets, drops

    def close(self) -> None:
        self.sock.close()

"""Listening sockets whose bind errors name the address (one helper for every server we start)."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable


def bind_listen(host: str, port: int, backlog: int = 1024) -> socket.socket:
    """A non-blocking listening TCP socket on host:port (0 = a free port).

    Raises OSError whose message names host:port, e.g. "cannot listen on 127.0.0.1:8000: Address
    already in use".
    """
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError as exc:
        sock.close()
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        raise OSError(exc.errno, f"cannot listen on {where}: {exc.strerror or exc}") from None
    sock.setblocking(False)
    return sock


def read_now(read: Callable[[], bytes]) -> bytes | None:
    """What a non-blocking `read()` gives now: None when nothing has arrived yet, b"" at the end of
    the stream or on an error, else the bytes."""
    try:
        return read()
    except (BlockingIOError, InterruptedError):
        return None
    except OSError:
        return b""


#: Kernel buffers of a channel's socket, each end (the kernel caps them at net.core.wmem_max and
#: rmem_max): at ~7 MB/s of frames the default 208 KiB fills when the analysis is away for 30 ms,
#: and every full socket costs the relay a partial send and a wait for writability.
SOCKET_BUFFER_BYTES = 4 << 20


def size_buffers(sock: socket.socket, nbytes: int = SOCKET_BUFFER_BYTES) -> None:
    """Ask for `nbytes` kernel buffers each way on a channel socket (best effort)."""
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, opt, nbytes)

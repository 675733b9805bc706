"""A real etcd server (Debian's `etcd-server`, installed by scripts/test.sh) on free loopback
ports in a temporary data directory, for the lease tests."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import httpx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EtcdServer:
    """`with EtcdServer() as etcd:` — `etcd.url` is its client URL (the v3 JSON gateway too)."""

    def __init__(self) -> None:
        exe = shutil.which("etcd")
        if exe is None:
            raise AssertionError("etcd is not installed: scripts/test.sh installs Debian's etcd-server")
        self.exe = exe
        self.dir = Path(tempfile.mkdtemp(prefix="shadow-etcd-"))
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""

    def __enter__(self) -> EtcdServer:
        for _ in range(5):  # a port may be taken between the probe and the bind
            client, peer = _free_port(), _free_port()
            self.url = f"http://127.0.0.1:{client}"
            peer_url = f"http://127.0.0.1:{peer}"
            log = (self.dir / "etcd.log").open("ab")
            self.proc = subprocess.Popen(
                [self.exe, "--name", "t", "--data-dir", str(self.dir / "data"),
                 "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
                 "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
                 "--initial-cluster", f"t={peer_url}", "--log-level", "warn"],
                stdout=log, stderr=log)
            log.close()
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and self.proc.poll() is None:
                try:
                    if httpx.get(self.url + "/health", timeout=2).json().get("health") == "true":
                        return self
                except (httpx.HTTPError, ValueError):
                    pass
                time.sleep(0.1)
            self._stop()
        raise AssertionError(f"etcd did not start: {(self.dir / 'etcd.log').read_text()[-2000:]}")

    def _stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def __exit__(self, *exc: object) -> None:
        self._stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class DelayProxy:
    """`with DelayProxy(upstream_url, delay_s) as proxy:` — a TCP proxy on a free loopback port
    (`proxy.url`) that passes requests on at once and holds every piece of an answer `delay_s`
    before passing it back (in order): a server that answers in `delay_s`. Runs on a thread of
    its own, so that the caller's event loop does not pace it."""

    def __init__(self, upstream: str, delay_s: float) -> None:
        parts = httpx.URL(upstream)
        self.target = (parts.host, parts.port or 80)
        self.delay_s = delay_s
        self.url = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="delay-proxy", daemon=True)

    def _run(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._loop.run_until_complete(self._serve())
        self._loop.close()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        self._ready.set()
        await self._stop.wait()
        server.close()
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in others:
            t.cancel()
        await asyncio.gather(*others, return_exceptions=True)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return

        async def pass_on(src: asyncio.StreamReader, dst: asyncio.StreamWriter, delay: float) -> None:
            pending: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

            async def deliver() -> None:
                while True:
                    due, data = await pending.get()
                    await asyncio.sleep(max(0.0, due - time.monotonic()))
                    if not data:
                        break
                    dst.write(data)
                    await dst.drain()

            sender = asyncio.create_task(deliver())
            try:
                while data := await src.read(1 << 16):
                    pending.put_nowait((time.monotonic() + delay, data))
            finally:
                pending.put_nowait((time.monotonic() + delay, b""))
                with contextlib.suppress(OSError):
                    await sender
                dst.close()

        try:
            await asyncio.gather(pass_on(reader, up_writer, 0.0), pass_on(up_reader, writer, self.delay_s))
        except (OSError, asyncio.CancelledError):  # the proxy stops (asyncio's callback cannot take a
            writer.close()                         # cancelled handler)
            up_writer.close()

    def __enter__(self) -> DelayProxy:
        self._thread.start()
        if not self._ready.wait(30):
            raise AssertionError("the delaying proxy did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

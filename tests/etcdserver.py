"""A real etcd server (Debian's `etcd-server`, installed by scripts/test.sh) on free loopback
ports in a temporary data directory, for the lease tests."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
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

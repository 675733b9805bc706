"""The data-plane process of a tap group: it holds the listening sockets for the group's lifetime and
keeps one relay (`shadow.dataplane.relay`) serving them.

- A relay that dies (a crash, `kill -9`) is replaced at once by a fork of this process (no new
  interpreter to start): its streams are cut — the kernel closes their sockets mid-body — and
  connections made meanwhile wait in the listening sockets' queues, which stay open here.
- `reload` (SIGHUP, or the control socket): a new relay is started from the code now installed
  (a fresh interpreter that inherits the listening sockets), and once it accepts, the old one
  stops accepting and drains: nothing is refused, no stream is cut, and no keep-alive connection
  is closed under a client that may be sending on it (each is answered `connection: close` on
  its next request, or closed by its client, or at the drain timeout). Sockets are shared, never
  re-bound (a closed SO_REUSEPORT listener would drop its accept queue).
- `stop` (SIGTERM/SIGINT, or the control socket): the listening sockets are closed at once (a new
  connection is refused, so a client can retry elsewhere, instead of waiting in a queue nobody
  will serve), the relay drains (up to the drain timeout), then the process exits; a second
  signal ends the relay at once.
- The relays end with this process, however it ends (`kill -9` included): the kernel sends each a
  hand-over drain (SIGUSR2, PR_SET_PDEATHSIG), so they stop accepting, let their streams finish
  and exit; no relay outlives its supervisor unsupervised, and never do two generations (a
  reload's old and new relay) both accept with no one to end one of them. A new `shadow tap` of
  the group takes over its directory at once (the lock was this process's only).
- `lifeline_fd` (a group bound to the process that started it, `shadow serve` with a temporary
  state directory): its end (EOF) is a `stop`.

The control socket (`ctl.sock` in the group's directory) takes one JSON line and answers one:
`{"cmd": "status"|"reload"|"stop"}`. Nothing here touches request bytes.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shadow.base.net import read_now
from shadow.base.pids import die_with_parent, start_time
from shadow.dataplane.relay import RelaySockets, RelaySpec
from shadow.dataplane.rundir import RunDir, unix_listen

RESTART_BACKOFF_S = (0.0, 0.05, 0.1, 0.2, 0.5)  # after 1, 2, 3, 4, 5+ crashes within CRASH_WINDOW_S
CRASH_WINDOW_S = 10.0
READY_TIMEOUT_S = 120.0
CONTROL_MAX = 4096


def log(msg: str) -> None:
    print(f"shadow tap: {msg}", file=sys.stderr, flush=True)


class _Worker:
    """One relay process: how it was started, its ready pipe, whether it drains."""

    def __init__(
        self, pid: int, ready_fd: int, how: str, proc: subprocess.Popen[bytes] | None = None
    ) -> None:
        self.pid = pid
        self.ready_fd = ready_fd
        self.how = how  # "fork" | "exec"
        self.proc = proc
        self.ready: dict[str, Any] | None = None
        self.buf = b""
        self.draining = False
        self.started = time.monotonic()


class _Control:
    """The group's control socket (`run_dir.control`): one JSON line in (`{"cmd": ...}`), one out,
    per connection; a reload's answer waits for the new relay (`reload_waiters`)."""

    PARTIAL = object()  # `read`'s answer while a command's line is incomplete

    def __init__(self, sel: selectors.BaseSelector) -> None:
        self.sel = sel
        self.listener: socket.socket | None = None
        self.conns: dict[socket.socket, bytes] = {}
        self.reload_waiters: list[socket.socket] = []

    def listen(self, path: Path) -> None:
        self.listener = unix_listen(path)
        self.listener.setblocking(False)
        self.sel.register(self.listener, selectors.EVENT_READ, "ctl")

    def sockets(self) -> list[socket.socket]:
        return [*([self.listener] if self.listener is not None else []), *self.conns]

    def accept(self) -> None:
        assert self.listener is not None
        try:
            conn, _ = self.listener.accept()
        except (BlockingIOError, InterruptedError, OSError):
            return
        conn.setblocking(False)
        self.conns[conn] = b""
        self.sel.register(conn, selectors.EVENT_READ, conn)

    def read(self, conn: socket.socket) -> Any:
        """The command of `conn`'s first line once it is whole (None if it is not JSON with a
        "cmd"), else PARTIAL; a connection that closes early or sends too much is closed."""
        data = read_now(lambda: conn.recv(CONTROL_MAX))
        if data is None:
            return self.PARTIAL
        buf = self.conns.get(conn, b"") + data
        if not data or len(buf) > CONTROL_MAX:
            self._close(conn)
            return self.PARTIAL
        self.conns[conn] = buf
        if b"\n" not in buf:
            return self.PARTIAL
        self.sel.unregister(conn)
        try:
            return json.loads(buf.split(b"\n", 1)[0]).get("cmd")
        except (ValueError, AttributeError):
            return None

    def reply(self, conn: socket.socket, doc: dict[str, Any]) -> None:
        with contextlib.suppress(OSError):
            conn.setblocking(True)
            conn.settimeout(2.0)
            conn.sendall(json.dumps(doc).encode() + b"\n")
        self.conns.pop(conn, None)
        with contextlib.suppress(OSError):
            conn.close()

    def answer_reloads(self, doc: dict[str, Any]) -> None:
        waiters, self.reload_waiters = self.reload_waiters, []
        for conn in waiters:
            self.reply(conn, doc)

    def _close(self, conn: socket.socket) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(conn)
        self.conns.pop(conn, None)
        conn.close()

    def close(self) -> None:
        for conn in list(self.conns):
            with contextlib.suppress(OSError):
                conn.close()
        if self.listener is not None:
            self.listener.close()


class Supervisor:
    """See module docstring. `run()` blocks until the group stops; its exit code."""

    def __init__(
        self,
        spec: RelaySpec,
        sockets: RelaySockets,
        *,
        run_dir: RunDir | None,
        drain_timeout_s: float = 30.0,
        ready: Callable[[dict[str, Any]], None] | None = None,
        argv_record: dict[str, Any] | None = None,
        lifeline_fd: int | None = None,
    ) -> None:
        self.spec = spec
        self.sockets = sockets
        self.run_dir = run_dir
        self.drain_timeout_s = drain_timeout_s
        self.on_ready = ready
        self.record_extra = argv_record or {}
        self.workers: dict[int, _Worker] = {}
        self.current: _Worker | None = None
        self.pending: _Worker | None = None  # a reload's new relay, until it accepts
        self.restarts = 0
        self.crashes: list[float] = []
        self.stopping = False
        self.forced = False  # stopped by a second signal: streams may have been cut
        self.stop_deadline = 0.0
        self.announced = False
        self.sel = selectors.DefaultSelector()
        self._signals: list[int] = []
        self._wake_r, self._wake_w = socket.socketpair()
        self._ctl = _Control(self.sel)
        self._restart_at = 0.0
        self._lifeline = lifeline_fd
        self._pid = os.getpid()

    # -- the loop ------------------------------------------------------------------------------------

    def run(self) -> int:
        for s in (self._wake_r, self._wake_w):
            s.setblocking(False)
        signal.set_wakeup_fd(self._wake_w.fileno())
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(sig, self._on_signal)
        self.sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        if self.run_dir is not None:
            self._ctl.listen(self.run_dir.control)
        if self._lifeline is not None:
            os.set_blocking(self._lifeline, False)
            self.sel.register(self._lifeline, selectors.EVENT_READ, "lifeline")
        self.current = self._fork()
        try:
            while True:
                for key, _ in self.sel.select(timeout=0.25):
                    self._dispatch(key)
                self._handle_signals()
                self._reap()
                if self.stopping:
                    if not self.workers:
                        return 1 if self.forced else 0
                    if time.monotonic() > self.stop_deadline:
                        for w in self.workers.values():
                            with contextlib.suppress(ProcessLookupError):
                                os.kill(w.pid, signal.SIGKILL)
                elif self.current is None and time.monotonic() >= self._restart_at:
                    self.current = self._fork()
        finally:
            self._shutdown()

    def _dispatch(self, key: selectors.SelectorKey) -> None:
        what = key.data
        if what == "wake":
            with contextlib.suppress(OSError):
                while self._wake_r.recv(4096):
                    pass
        elif what == "ctl":
            self._ctl.accept()
        elif what == "lifeline":
            self._read_lifeline()
        elif isinstance(what, _Worker):
            self._read_ready(what)
        elif isinstance(what, socket.socket):
            conn, cmd = what, self._ctl.read(what)
            if cmd is not _Control.PARTIAL:
                self._command(conn, cmd)

    def _on_signal(self, signum: int, _frame: object) -> None:
        self._signals.append(signum)

    def _handle_signals(self) -> None:
        sigs, self._signals = self._signals, []
        for sig in sigs:
            if sig in (signal.SIGTERM, signal.SIGINT):
                if self.stopping:
                    log("second signal: ending the relay now")
                    self.forced = True
                    self._signal_all(signal.SIGUSR1)  # "now" (two quick SIGTERMs may arrive as one)
                else:
                    self.stop()
            elif sig == signal.SIGHUP:
                self.reload()

    # -- relays --------------------------------------------------------------------------------------

    def _spec(self) -> RelaySpec:
        return RelaySpec.from_dict({**self.spec.to_dict(), "restarts": self.restarts})

    def _fork(self) -> _Worker:
        """A relay forked from this process (fast: nothing to import)."""
        r, w = os.pipe()
        spec = self._spec()
        pid = os.fork()
        if pid == 0:  # the relay
            code = 1
            try:
                os.close(r)
                signal.set_wakeup_fd(-1)
                for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD):
                    signal.signal(sig, signal.SIG_DFL)
                self.sel.close()
                for s in (self._wake_r, self._wake_w, *self._ctl.sockets()):
                    s.close()
                for wk in self.workers.values():
                    with contextlib.suppress(OSError):
                        os.close(wk.ready_fd)
                if self.run_dir is not None and self.run_dir.lock_fd is not None:
                    os.close(self.run_dir.lock_fd)  # the group's lock is the supervisor's alone
                from shadow.dataplane.relay import serve_relay

                code = (
                    serve_relay(spec, self.sockets, w, self.drain_timeout_s)
                    if die_with_parent(signal.SIGUSR2, self._pid)
                    else 0  # the supervisor is already gone: serve nothing
                )
            finally:
                os._exit(code)
        os.close(w)
        worker = _Worker(pid, r, "fork")
        self._track(worker)
        return worker

    def _exec(self) -> _Worker:
        """A relay in a fresh interpreter running the code now installed (reload, upgrade)."""
        r, w = os.pipe()
        fds = {
            "taps": {n: s.fileno() for n, s in self.sockets.taps.items()},
            "attach": [s.fileno() for s in self.sockets.attach],
            "admin": self.sockets.admin.fileno() if self.sockets.admin is not None else None,
        }
        boot = "from shadow.dataplane.relay import main; main()"
        parent = self._pid

        def tie() -> None:  # in the child, before exec (this process has one thread)
            if not die_with_parent(signal.SIGUSR2, parent):
                os._exit(0)

        proc = subprocess.Popen(
            [sys.executable, "-c", boot],
            stdin=subprocess.PIPE,
            pass_fds=[w, *(s.fileno() for s in self.sockets.all())],
            start_new_session=False,
            preexec_fn=tie,
        )
        assert proc.stdin is not None
        proc.stdin.write(
            json.dumps(
                {
                    "spec": self._spec().to_dict(),
                    "fds": fds,
                    "ready_fd": w,
                    "drain_timeout_s": self.drain_timeout_s,
                }
            ).encode()
            + b"\n"
        )
        proc.stdin.close()
        os.close(w)
        worker = _Worker(proc.pid, r, "exec", proc)
        self._track(worker)
        return worker

    def _track(self, worker: _Worker) -> None:
        os.set_blocking(worker.ready_fd, False)
        self.workers[worker.pid] = worker
        self.sel.register(worker.ready_fd, selectors.EVENT_READ, worker)

    def _read_ready(self, worker: _Worker) -> None:
        data = read_now(lambda: os.read(worker.ready_fd, 65536))
        if data is None:
            return
        if not data:
            self._unwatch(worker)
            return
        worker.buf += data
        if b"\n" not in worker.buf or worker.ready is not None:
            return
        line = worker.buf.split(b"\n", 1)[0]
        try:
            worker.ready = json.loads(line)
        except ValueError:
            worker.ready = {}
        self._on_worker_ready(worker)

    def _unwatch(self, worker: _Worker) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(worker.ready_fd)
        with contextlib.suppress(OSError):
            os.close(worker.ready_fd)
        worker.ready_fd = -1

    def _on_worker_ready(self, worker: _Worker) -> None:
        if worker is self.pending:  # a reload's relay accepts: the old one drains
            old, self.current, self.pending = self.current, worker, None
            if old is not None:
                old.draining = True
                with contextlib.suppress(ProcessLookupError):
                    os.kill(old.pid, signal.SIGUSR2)  # hand over: drain, leaving idle connections be
            log(f"reloaded: relay pid {worker.pid} serves; pid {old.pid if old else '-'} drains its streams")
            self._ctl.answer_reloads({"ok": True, "relay_pid": worker.pid})
        self._write_record()
        if not self.announced and worker is self.current and self.on_ready is not None:
            self.announced = True
            self.on_ready(self.status())

    def _reap(self) -> None:
        while self.workers:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            worker = self.workers.pop(pid, None)
            if worker is None:
                continue
            if worker.proc is not None:
                worker.proc.returncode = os.waitstatus_to_exitcode(status)
            if worker.ready_fd >= 0:
                self._unwatch(worker)
            code = os.waitstatus_to_exitcode(status)
            how = f"signal {-code}" if code < 0 else f"code {code}"
            if worker is self.pending:
                self.pending = None
                log(
                    f"reload failed: the new relay (pid {pid}) exited ({how}) before accepting; "
                    f"pid {self.current.pid if self.current else '-'} still serves"
                )
                error = f"the new relay exited ({how}) before accepting"
                self._ctl.answer_reloads({"ok": False, "error": error})
            elif worker is self.current:
                self.current = None
                if not self.stopping:
                    self._crashed(pid, how)
            self._write_record()

    def _crashed(self, pid: int, how: str) -> None:
        now = time.monotonic()
        self.crashes = [t for t in self.crashes if now - t < CRASH_WINDOW_S] + [now]
        delay = RESTART_BACKOFF_S[min(len(self.crashes), len(RESTART_BACKOFF_S)) - 1]
        self.restarts += 1
        self._restart_at = now + delay
        log(
            f"relay pid {pid} exited ({how}): its streams were cut; restarting it"
            + (f" in {delay:.2f} s" if delay else "")
        )

    def _signal_all(self, sig: int) -> None:
        for w in self.workers.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(w.pid, sig)

    # -- commands ------------------------------------------------------------------------------------

    def reload(self) -> bool:
        """Start a new relay from the installed code; the old one drains once it accepts."""
        if self.stopping or self.pending is not None or self.current is None:
            return False
        self.pending = self._exec()
        log(f"reload: starting relay pid {self.pending.pid}")
        return True

    def stop(self) -> None:
        if self.stopping:
            return
        self.stopping = True
        self.stop_deadline = time.monotonic() + self.drain_timeout_s + 10.0
        log(f"stopping: the relay drains its streams (up to {self.drain_timeout_s:g} s); new connections "
            f"are refused")
        self._signal_all(signal.SIGTERM)
        for s in self.sockets.all():  # the relays close theirs as they begin to drain
            with contextlib.suppress(OSError):
                s.close()
        self._ctl.answer_reloads({"ok": False, "error": "stopping"})

    def status(self) -> dict[str, Any]:
        cur = self.current
        ready = cur.ready if cur is not None and cur.ready else {}
        return {
            "pid": os.getpid(),
            "group": self.spec.group,
            "relay_pid": cur.pid if cur is not None else None,
            "relay_id": ready.get("relay_id"),
            "taps": {t["name"]: t["url"] for t in ready.get("taps", [])},
            "metrics": ready.get("admin", ""),
            "attach": f"unix:{self.run_dir.attach}" if self.run_dir is not None else "",
            "restarts": self.restarts,
            "relays": [[pid, start_time(pid)] for pid in self.workers],  # (pid, start): verifiable
            "stopping": self.stopping,
            **self.record_extra,
        }

    def _write_record(self) -> None:
        if self.run_dir is not None and not self.stopping:
            with contextlib.suppress(OSError):
                self.run_dir.write(self.status())

    def _read_lifeline(self) -> None:
        fd = self._lifeline
        assert fd is not None
        data = read_now(lambda: os.read(fd, 4096))
        if data is None or data:
            return
        with contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(fd)
        self._lifeline = None
        log("the process this group is bound to ended: stopping")
        self.stop()

    def _command(self, conn: socket.socket, cmd: Any) -> None:
        """Carry out one control command and answer it (a reload: once the new relay accepts)."""
        if cmd == "status":
            self._ctl.reply(conn, {"ok": True, **self.status()})
        elif cmd == "stop":
            self._ctl.reply(conn, {"ok": True})
            self.stop()
        elif cmd == "reload":
            if self.reload():
                self._ctl.reload_waiters.append(conn)
            else:
                self._ctl.reply(
                    conn, {"ok": False, "error": "a reload is under way" if self.pending else "not serving"}
                )
        else:
            self._ctl.reply(conn, {"ok": False, "error": "unknown command (status, reload, stop)"})

    def _shutdown(self) -> None:
        signal.set_wakeup_fd(-1)
        self._ctl.close()
        for s in self.sockets.all():
            with contextlib.suppress(OSError):
                s.close()
        if self.run_dir is not None:
            self.run_dir.clean()
        self.sel.close()


def control(run_dir: RunDir, cmd: str, timeout_s: float = 180.0) -> dict[str, Any]:
    """Send one command to a running group's supervisor; its answer (OSError: nobody listens)."""
    from shadow.dataplane.rundir import unix_connect

    sock = unix_connect(run_dir.control, timeout_s=timeout_s)
    with sock:
        sock.sendall(json.dumps({"cmd": cmd}).encode() + b"\n")
        buf = b""
        while b"\n" not in buf:
            chunk = sock.recv(65536)
            if not chunk:
                break
            buf += chunk
    try:
        doc = json.loads(buf.split(b"\n", 1)[0])
    except ValueError:
        raise OSError(f"no answer from the tap group {run_dir.name!r} ({cmd})") from None
    return doc if isinstance(doc, dict) else {"ok": False}

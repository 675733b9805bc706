"""`shadow tap` as a process: one tap group's data plane (its supervisor holding the listening
sockets, and the relay serving them), or a command to a running group.

    run(TapGroupConfig(upstreams={"d0": "http://..."}, name="d0"))   # blocks until stopped

Sockets come from systemd socket activation when it passed them (LISTEN_FDS, named after the
taps, `metrics` and `attach`), else are bound here: taps on `port`, `port`+1, ... in the order
upstream, prefill, front (0: ephemeral), the admin endpoint on `metrics_port`, the attach socket in
the group's directory (and on `attach_listen`, TCP, with a token; its real port, when 0 was asked
for, is what the ready line, the record and `--status` name).

A group whose supervisor was lost (`kill -9`: its relays drained and ended with it) is taken over
by the next `shadow tap` of its name, which binds the ports it had where its own are 0 (so that
the router, pointed at them, needs no change), retrying while the last relays close them.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shadow.base.knobs import check_knobs
from shadow.base.net import bind_listen
from shadow.base.runtime import raise_fd_limit
from shadow.base.security import Untrusted
from shadow.base.statedir import state_dir
from shadow.dataplane.http1 import TapLimits
from shadow.dataplane.relay import RelayBounds, RelaySockets, RelaySpec
from shadow.dataplane.rundir import RunDir, digest, groups, unix_listen
from shadow.dataplane.supervisor import Supervisor, control

PROG = "shadow tap"
SD_LISTEN_FDS_START = 3
REBIND_S = 10.0  # how long a taken-over group retries the ports its lost relays still close


@dataclass
class TapGroupConfig(RelayBounds):
    """What `shadow tap` is told: taps {name: upstream URL} by role, where to listen, the bounds."""

    upstreams: dict[str, str]
    prefill: dict[str, str] = field(default_factory=dict)
    front: dict[str, str] = field(default_factory=dict)
    host: str = "127.0.0.1"
    port: int = 0
    metrics_port: int = 0
    name: str | None = None
    state_dir: str | None = None
    attach_listen: str | None = None
    attach_token: str | None = None
    digest: str | None = None
    limits: TapLimits = field(default_factory=TapLimits)
    drain_timeout_s: float = 30.0
    bound: bool = False  # the group stops when its stdin ends (the process that started it is gone)

    def taps(self) -> list[dict[str, str]]:
        return (
            [{"name": n, "upstream": u, "role": "decode"} for n, u in self.upstreams.items()]
            + [{"name": n, "upstream": u, "role": "prefill"} for n, u in self.prefill.items()]
            + [{"name": n, "upstream": u, "role": "front"} for n, u in self.front.items()]
        )

    def validate(self) -> None:
        names = [t["name"] for t in self.taps()]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"names used twice: {sorted(dup)}")
        if not names:
            raise ValueError("nothing to tap: give --upstream, --prefill or --front")
        for t in self.taps():
            if not t["upstream"].startswith("http://"):
                raise ValueError(f"upstream {t['upstream']!r}: only http://host:port is supported")
        if self.attach_listen and not self.attach_token:
            raise ValueError(
                "--attach-listen needs --attach-token (or SHADOW_ATTACH_TOKEN): the attach "
                "stream carries request bodies"
            )
        if self.attach_token is not None and len(self.attach_token) < 16:
            raise ValueError("the attach token must be at least 16 characters")
        check_knobs(self)  # the relay's bounds (`RelayBounds`)
        check_knobs(self.limits)
        if not self.drain_timeout_s >= 0:
            raise ValueError(f"--drain-timeout must be >= 0 s, got {self.drain_timeout_s}")

    def group_name(self) -> str:
        if self.name:
            return self.name
        joined = "-".join(t["name"] for t in self.taps())
        return (
            joined
            if len(joined) <= 64 and joined.replace("-", "").replace("_", "").isalnum()
            else "taps-" + digest(sorted(t["name"] for t in self.taps()))[:8]
        )

    def spec(self) -> RelaySpec:
        lim = self.limits
        return RelaySpec(
            taps=self.taps(),
            limits={k: getattr(lim, k) for k in lim.__dataclass_fields__},
            **self.bounds(),
            attach_token=self.attach_token,
            group=self.group_name(),
        )


def _systemd_sockets() -> dict[str, socket.socket]:
    """Sockets systemd passed to this process (socket activation), by FileDescriptorName."""
    if os.environ.get("LISTEN_PID") != str(os.getpid()):
        return {}
    n = int(os.environ.get("LISTEN_FDS", "0") or 0)
    names = os.environ.get("LISTEN_FDNAMES", "").split(":")
    out: dict[str, socket.socket] = {}
    for i in range(n):
        fd = SD_LISTEN_FDS_START + i
        os.set_inheritable(fd, True)
        out[names[i] if i < len(names) and names[i] else f"fd{fd}"] = socket.socket(fileno=fd)
    for k in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        os.environ.pop(k, None)  # not for the relays it starts
    return out


def _run_dir(config: TapGroupConfig) -> RunDir:
    """The group's directory; a private temporary one (with a warning) when the default state
    directory cannot be written (an analysis then needs the printed attach address)."""
    base, explicit = state_dir(config.state_dir, os.environ)
    rd = RunDir(base, config.group_name())
    try:
        rd.create()
    except OSError as exc:
        if explicit or isinstance(exc, Untrusted):
            raise
        tmp = Path(tempfile.mkdtemp(prefix="shadow-tap-"))
        print(
            f"{PROG}: {exc}; using {tmp} instead: an analysis finds this group only by the attach "
            f"address printed below",
            file=sys.stderr,
            flush=True,
        )
        rd = RunDir(tmp, config.group_name())
        rd.create()
    return rd


def _port(url: str) -> int:
    """The port of "http://h:p" or "tcp://h:p" (0 when there is none)."""
    tail = url.rsplit(":", 1)[-1].split("/", 1)[0]
    return int(tail) if tail.isdigit() else 0


def _address(sock: socket.socket) -> str:
    h, p = sock.getsockname()[:2]
    return f"[{h}]:{p}" if ":" in h else f"{h}:{p}"


def _bind(host: str, port: int, backlog: int, retry_s: float) -> socket.socket:
    """`bind_listen`, retrying "address in use" for up to `retry_s` (a lost group's relays close
    the listeners they drain from)."""
    deadline = time.monotonic() + retry_s
    while True:
        try:
            return bind_listen(host, port, backlog=backlog)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _sockets(config: TapGroupConfig, rd: RunDir, before: dict[str, Any]) -> RelaySockets:
    """The listening sockets: passed by systemd, else bound; where a port is 0, the one the lost
    group `before` (its record; {} for none) had, else a free one."""
    passed = _systemd_sockets()
    retry = REBIND_S if before else 0.0
    had_taps = before.get("taps") or {}
    taps: dict[str, socket.socket] = {}
    made: list[socket.socket] = []

    def bind(host: str, port: int, had: int, backlog: int = 1024) -> socket.socket:
        if port or not had:
            s = _bind(host, port, backlog, retry)
        else:
            try:
                s = _bind(host, had, backlog, retry)
            except OSError as exc:
                print(f"{PROG}: {exc}; taking a free port instead", file=sys.stderr, flush=True)
                s = bind_listen(host, 0, backlog=backlog)
        made.append(s)
        return s

    try:
        for i, t in enumerate(config.taps()):
            s = passed.pop(t["name"], None)
            if s is None:
                had = _port(str(had_taps.get(t["name"], "")))
                s = bind(config.host, config.port + i if config.port else 0, had, backlog=4096)
            taps[t["name"]] = s
        admin = passed.pop("metrics", None)
        if admin is None:
            admin = bind(config.host, config.metrics_port, _port(str(before.get("metrics", ""))))
        attach = [passed.pop("attach", None) or unix_listen(rd.attach)]
        if config.attach_listen:
            host, _, port = config.attach_listen.rpartition(":")
            if not port.isdigit():
                raise ValueError(f"--attach-listen {config.attach_listen!r}: expected HOST:PORT")
            attach.append(bind(host.strip("[]") or config.host, int(port),
                               _port(str(before.get("attach_tcp", "")))))
    except BaseException:
        for s in made:
            s.close()
        raise
    for s in passed.values():
        s.close()  # passed but not ours to serve
    for s in [*taps.values(), admin, *attach]:
        s.setblocking(False)
        os.set_inheritable(s.fileno(), True)
    return RelaySockets(taps=taps, attach=attach, admin=admin)


def _taken_over(rd: RunDir) -> dict[str, Any]:
    """The record a lost group left (its supervisor gone: this process holds the lock now), or {}."""
    before = rd.read() or {}
    rd.clean()  # (no one takes the lost group's record for this one's)
    if before:
        print(
            f"{PROG}: tap group {rd.name!r}: its supervisor (pid {before.get('pid', '?')}) was lost; "
            f"taking over (its relays drain and end by themselves)",
            file=sys.stderr,
            flush=True,
        )
    return before


def run(config: TapGroupConfig) -> None:
    """Serve the group until it is stopped (ValueError: bad configuration; OSError: ports, files)."""
    config.validate()
    raise_fd_limit()
    rd = _run_dir(config)
    rd.lock()
    sockets = _sockets(config, rd, _taken_over(rd))
    extra = {
        "digest": config.digest or digest(config.spec().to_dict() | {"attach_token": None}),
        "dir": str(rd.path),
        "state_dir": str(rd.path.parent.parent),
    }
    if config.attach_listen:
        extra["attach_tcp"] = f"tcp://{_address(sockets.attach[-1])}"

    def ready(status: dict[str, Any]) -> None:
        doc = {k: status[k] for k in ("taps", "metrics", "attach", "pid", "group")}
        doc["dir"] = str(rd.path)
        if "attach_tcp" in status:
            doc["attach_tcp"] = status["attach_tcp"]
        print(json.dumps(doc), flush=True)

    sup = Supervisor(
        config.spec(),
        sockets,
        run_dir=rd,
        drain_timeout_s=config.drain_timeout_s,
        ready=ready,
        argv_record=extra,
        lifeline_fd=sys.stdin.fileno() if config.bound else None,
    )
    if sup.run():
        raise SystemExit(1)  # a second signal cut the drain short (logged)


def command(cmd: str, state: str | None, name: str | None, *, every: bool = False) -> list[dict[str, Any]]:
    """`cmd` (stop, reload, status) to the named group, or (`every`) to all of them; the answers.
    A group whose supervisor was lost (its record left behind) answers from its directory
    (`lost`). ValueError when which group is meant is unclear; OSError when none answers or a
    directory is not to be trusted."""
    base, _ = state_dir(state, os.environ)
    if name:
        targets = [RunDir(base, name)]
    else:
        targets = [g for g in groups(base) if g.read() is not None]
        if not targets:
            raise OSError(f"no tap group runs in {base} (give --state-dir or --name)")
        if len(targets) > 1 and not every:
            raise ValueError(
                f"{len(targets)} tap groups run in {base} ({', '.join(g.name for g in targets)}): "
                f"give --name NAME{' or --all' if cmd != 'reload' else ''}"
            )
    answers = []
    for rd in targets:
        rd.check()
        rec = rd.read()
        if not rd.locked_by_someone():
            if rec is None:
                raise OSError(f"tap group {rd.name!r} does not run in {base}")
            answers.append({"group": rd.name, **lost(rd, cmd, rec)})
            continue
        try:
            doc = control(rd, cmd)
        except OSError as exc:
            if name:
                raise OSError(
                    f"tap group {rd.name!r} in {base} does not answer: {exc.strerror or exc}"
                ) from None
            continue
        answers.append({"group": rd.name, **doc})
    return answers


def lost(rd: RunDir, cmd: str, rec: dict[str, Any]) -> dict[str, Any]:
    """The answer of a group whose supervisor is gone (`rec`: the record it left): `status` says
    so and names its relays still draining; `stop` tells those to stop waiting for idle
    connections and removes the record; `reload` has nothing to reload."""
    relays = rd.relays(rec)
    gone = (
        f"the supervisor (pid {rec.get('pid', '?')}) is gone; "
        + (f"its relays {relays} drain and end by themselves" if relays else "no relay of it runs")
    )
    if cmd == "stop":
        for pid in relays:  # verified by their start time: never a recycled pid
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        rd.clean()
        return {"ok": True, "running": False, "pid": rec.get("pid"), "relays": relays, "note": gone}
    again = f"start it again (shadow tap --name {rd.name} ...) to recover"
    return {"ok": False, "running": False, "pid": rec.get("pid"), "relays": relays,
            "error": f"{gone}; {again}" if cmd == "status" else f"{gone}: nothing to reload; {again}"}

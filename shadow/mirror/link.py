"""The analysis's link to a data plane in processes of its own (`MirrorConfig.relay == "process"`).

`RelayLink` holds what `MirrorService` needs of it: the tap group it starts for its own taps (or
adopts after a restart, found in the state directory) or the groups it is told to attach to, one
`Attachment` per group, the channel readers behind them (`readers`, `reader_of`), their sync
tokens and acknowledgements, and the group's restart when its supervisor is lost. `open` happens
on the caller's loop; `start`, `sync_all`, `wait_attached`, `housekeep` and `aclose` on the
analysis loop, where the attachments run.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from shadow.base.knobs import knob_argv
from shadow.base.pidlock import PidLock
from shadow.base.security import Untrusted
from shadow.base.statedir import state_dir
from shadow.dataplane.http1 import TapLimits
from shadow.dataplane.relay import RelayBounds, boot_id
from shadow.dataplane.rundir import GROUPS, digest, hold_analysis_lock, prepare_state_dir
from shadow.mirror.attach import Attachment
from shadow.mirror.channel_reader import ChannelReader
from shadow.mirror.config import MirrorConfig
from shadow.mirror.groups import ManagedGroup
from shadow.mirror.relayview import RemoteTap

log = logging.getLogger("shadow.mirror")

#: What an attachment hands the analysis: a relay's reader and its decoded items, in order.
OnItems = Callable[[ChannelReader, list[tuple[Any, int, float, Any]]], None]


class RelayLink:
    """See module docstring. `config` and `limits` say which group this analysis starts (its
    `shadow tap` command line is derived from them: `group_spec`)."""

    def __init__(self, config: MirrorConfig, limits: TapLimits, clock: Callable[[], float],
                 on_items: OnItems) -> None:
        self.config = config
        self.limits = limits
        self.clock = clock
        self._on_items = on_items
        self.attachments: list[Attachment] = []
        self.group: ManagedGroup | None = None
        self._sync_token = 0
        self._groups_dir: Path | None = None
        self._temporary = False  # the state directory is a temporary one (`state_dir`)
        self._lock: PidLock | None = None  # this analysis's (`hold_analysis_lock`)
        self._recovery: asyncio.Task[None] | None = None  # starting a lost group again
        self._closing = False  # `close_group` began: a group lost now is not started again

    # -- readers --------------------------------------------------------------------------------

    def readers(self) -> list[ChannelReader]:
        return [r for a in self.attachments for r in a.readers]

    def reader_of(self, tap: str) -> ChannelReader | None:
        """The reader of the relay serving `tap` now (the newest that named it in its hello)."""
        found = None
        for a in self.attachments:
            for r in a.readers:
                if any(t.get("name") == tap for t in r.hello.get("taps", [])):
                    found = r
        return found

    def next_token(self) -> int:
        """A fresh sync token (`sync_all`): a reader has answered it once its `token` reaches it."""
        self._sync_token += 1
        return self._sync_token

    async def sync_all(self, token: int) -> list[ChannelReader]:
        """Analysis loop: ask every relay for a mark answering `token`; the readers to watch."""
        return [r for a in self.attachments for r in a.sync(token)]

    def snapshot(self) -> dict[str, Any]:
        """`/v1/state`'s part: the attachments and the group this analysis started or adopted."""
        out: dict[str, Any] = {"attached": [a.snapshot() for a in self.attachments]}
        if self.group is not None:
            out["tap_group"] = {"name": self.group.run_dir.name, "dir": str(self.group.run_dir.path),
                                "adopted": self.group.adopted, "recovered": self.group.recovered}
        return out

    # -- the group ------------------------------------------------------------------------------

    def group_spec(self) -> tuple[list[str], str]:
        """The `shadow tap` command line of the group this analysis starts, and its digest."""
        from shadow.base.procs import shadow_argv

        c, lim = self.config, self.limits
        data_plane: dict[str, Any] = {
            "upstreams": c.upstreams, "prefill": c.prefill, "front": c.front, "host": c.host,
            "port": c.port + 1 if c.port else 0, "admin_port": c.admin_port, "max_body": c.max_body,
            "inject_usage": c.inject_usage, "queue_size": c.queue_size, "queue_bytes": c.queue_bytes,
            "retain_bytes": c.retain_bytes, "retain_ended": c.retain_ended, "loop": c.loop,
            "limits": {k: getattr(lim, k) for k in lim.__dataclass_fields__},
        }
        dig = digest(data_plane)
        name = c.group or f"serve-{dig[:12]}"
        argv = ["tap", "--name", name, "--state-dir", str(self.state_dir()), "--digest", dig,
                "--host", c.host, "--port", str(data_plane["port"]), "--metrics-port", str(c.admin_port),
                "--drain-timeout", str(c.drain_timeout_s),
                *RelayBounds(**{k: getattr(c, k) for k in RelayBounds.__dataclass_fields__}).argv(),
                *knob_argv(lim)]
        for flag, pairs in (("--upstream", c.upstreams), ("--prefill", c.prefill), ("--front", c.front)):
            for n, u in pairs.items():
                argv += [flag, f"{n}={u}"]
        for path in c.allow_paths:
            argv += ["--allow-path", path]
        return shadow_argv(*argv), dig

    def state_dir(self) -> Path:
        """Where this analysis's tap group lives: the state directory (made or checked: one another
        user could change is refused), or, when only the default was not writable, a private
        temporary one, with a warning; a group started there is bound to this process (it stops
        when this process ends, however: nothing else could find and adopt it)."""
        if self._groups_dir is not None:
            return self._groups_dir
        base, explicit = state_dir(self.config.state_dir, os.environ)
        try:
            prepare_state_dir(base)
        except Untrusted:
            raise
        except OSError as exc:
            if explicit:
                raise
            tmp = Path(tempfile.mkdtemp(prefix="shadow-state-"))
            log.warning("tap group: %s; using %s instead: a restart of this process will not find the "
                        "running tap group, so it stops when this process exits", exc.strerror or exc, tmp)
            base, self._temporary = tmp, True
        self._groups_dir = base
        return base

    async def open(self, taps: Sequence[RemoteTap], ready_timeout_s: float) -> None:
        """Caller's loop: take this analysis's lock on its groups, start (or adopt) its own group
        when it has taps and names none to attach to, and make one attachment per group (started
        on the analysis loop by `start`)."""
        c = self.config
        addresses = list(c.attach)
        if not addresses and taps:  # no taps (workers fed by the event API only): no group
            argv, dig = self.group_spec()
            name = argv[argv.index("--name") + 1]
            self._lock = hold_analysis_lock(self.state_dir(), [f"tap group {name!r}"], c.analysis_name)
            self.group = ManagedGroup(self.state_dir(), name, argv, dig, bound=self._temporary)
            rec = await asyncio.to_thread(self.group.ensure, ready_timeout_s)
            addresses = [str(self.group.run_dir.path)]
            for t in taps:
                t._url = rec.get("taps", {}).get(t.name, "")
        elif addresses:
            self._lock = hold_analysis_lock(self.state_dir(), addresses, c.analysis_name)
        me = boot_id()
        for address in addresses:
            self.attachments.append(Attachment(address, self._on_items, token=c.attach_token, boot_id=me,
                                               name=c.analysis_name,
                                               clock=self.clock, check=self.check_hello,
                                               oldest_s=max(1.0, c.event_skew_s - 5.0), max_body=c.max_body))

    def check_hello(self, hello: dict[str, Any]) -> str | None:
        """A relay must serve taps of this configuration, each in the role configured."""
        c = self.config
        roles = {**dict.fromkeys(c.upstreams, "decode"), **dict.fromkeys(c.prefill, "prefill"),
                 **dict.fromkeys(c.front, "front")}
        for t in hello.get("taps", []):
            name, role = t.get("name"), t.get("role", "decode")
            if name not in roles:
                return (f"the relay serves a tap {name!r} this analysis is not configured for "
                        f"(configured: {', '.join(roles) or 'none'})")
            if roles[name] != role:
                return f"tap {name!r} is a {role} tap there, {roles[name]} here"
        return None

    # -- on the analysis loop -------------------------------------------------------------------

    def start(self) -> None:
        for a in self.attachments:
            a.start()

    async def wait_attached(self, timeout_s: float) -> bool:
        got = await asyncio.gather(*(a.wait_attached(timeout_s) for a in self.attachments))
        return all(got)

    def not_attached(self) -> str:
        """Why `wait_attached` failed: each attachment without a snapshot, with its last error."""
        return "; ".join(f"{a.address}: {a.last_error or 'no snapshot'}" for a in self.attachments
                         if not (a.conn is not None and a.conn.reader.snapshot_done))

    def housekeep(self) -> asyncio.Task[None] | None:
        """Acknowledge what was processed and recorded (the relays may forget those ends); poll the
        group, and when its supervisor was lost, start it again: the task doing so, to be kept."""
        for a in self.attachments:
            a.ack()
        group = self.group
        if group is None:
            return None
        group.poll()
        if self._recovery is None and not self._closing and group.lost():
            self._recovery = asyncio.create_task(self._recover(group))
            return self._recovery
        return None

    async def _recover(self, group: ManagedGroup, backoff_s: float = 5.0) -> None:
        """Start this analysis's tap group again after its supervisor was lost (its relays ended
        with it): on the ports it had, so the router needs no change; the attachments find it."""
        try:
            log.warning("tap group %r lost its supervisor: starting it again", group.run_dir.name)
            await asyncio.to_thread(group.ensure, 60.0)
            group.recovered += 1
        except OSError as exc:
            log.warning("tap group %r: could not start it again: %s", group.run_dir.name, exc)
            await asyncio.sleep(backoff_s)
        finally:
            self._recovery = None

    async def aclose(self) -> None:
        """Acknowledge what was recorded (the relays may forget it) and close every attachment."""
        for a in self.attachments:
            a.ack()
            with contextlib.suppress(Exception):
                await a.aclose()

    # -- stopping -------------------------------------------------------------------------------

    async def close_group(self, settle: Callable[[], Awaitable[Any]]) -> None:
        """Caller's loop, at stop: a group this analysis started is stopped when the config says
        `stop_taps` or the group is bound to this process (it drains for its own --drain-timeout);
        `settle` then takes the last ends its relays sent; an emptied temporary state directory goes."""
        self._closing = True
        group = self.group
        if group is not None and (self.config.stop_taps or group.bound):
            await asyncio.to_thread(group.stop, self.config.drain_timeout_s + 15.0)
            with contextlib.suppress(Exception):
                await settle()  # the last ends the relay sent
            if group.bound and self._groups_dir is not None:  # the temporary state directory, if empty
                for d in (self._groups_dir / GROUPS, self._groups_dir):
                    with contextlib.suppress(OSError):
                        d.rmdir()

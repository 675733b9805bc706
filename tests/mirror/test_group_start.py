"""A tap group `shadow serve` starts that does not come up in time is ended, whole, before the
error: a failed start leaves nothing running (seen: a group that came up minutes after its serve
had given up, still running after the test run). A group's TCP attach port asked as 0 is reported
as bound (the ready line, the record, `--status`)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from shadow.base.procs import shadow_argv
from shadow.dataplane.rundir import RunDir
from shadow.mirror.groups import ManagedGroup
from tests.active.procs import shadow_process
from tests.telemetry.servers import wait_for


def test_a_group_that_does_not_come_up_in_time_is_ended_with_its_children(tmp_path: Path) -> None:
    child = tmp_path / "child.pid"
    # a "group" that never serves: a supervisor-like parent with a child in its process group
    code = ("import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', "
            "'import time; time.sleep(600)']); open(sys.argv[1], 'w').write(str(c.pid)); time.sleep(600)")
    group = ManagedGroup(tmp_path / "state", "g", [sys.executable, "-c", code, str(child)], "d")
    with pytest.raises(OSError, match="did not start serving within"):
        group.ensure(timeout_s=2.0)
    assert group.proc is not None and group.proc.poll() is not None  # the parent is gone, reaped
    if child.exists() and child.read_text():  # (the parent may not have got that far on a busy host)
        pid = int(child.read_text())
        wait_for(lambda: _gone(pid), 30, f"child {pid} ended with its group")


def _gone(pid: int) -> bool:
    """The process is gone or a zombie waiting for init."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.integration
def test_attach_listen_on_port_0_reports_the_port_bound_everywhere(tmp_path: Path) -> None:
    state = tmp_path / "state"
    argv = ["tap", "--upstream", "d0=http://127.0.0.1:9", "--name", "g", "--state-dir", str(state),
            "--attach-listen", "127.0.0.1:0", "--attach-token", "t" * 16]
    with shadow_process(argv) as (_, ready):
        where = ready["attach_tcp"]
        host, port = where.removeprefix("tcp://").rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) > 0, where
        assert RunDir(state, "g").read()["attach_tcp"] == where  # type: ignore[index]
        status = subprocess.run(shadow_argv("tap", "--status", "--name", "g", "--state-dir", str(state)),
                                capture_output=True, text=True, timeout=60)
        assert status.returncode == 0 and json.loads(status.stdout)["attach_tcp"] == where, status
        socket.create_connection((host, int(port)), timeout=10).close()  # and something listens there

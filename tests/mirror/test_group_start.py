"""A tap group `shadow serve` starts that does not come up in time is ended, whole, before the
error: a failed start leaves nothing running (seen: a group that came up minutes after its serve
had given up, still running after the test run)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from shadow.mirror.groups import ManagedGroup
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

"""deploy/image: the image builds on this machine (deploy/image/build.sh: a Debian base made by
mmdebstrap, cached by its recipe, then the Containerfile with podman; once per session) and runs as
shipped: `shadow fleet` and `shadow serve` each in a container as the image's non-root user on a
read-only root filesystem (no tmpfs either, as Kubernetes' readOnlyRootFilesystem), on the host's
network (loopback only), serve's state directory a host directory mounted at /var/lib/shadow.

Run flags: podman's runc, with explicit open-files and process limits. Podman's defaults (crun,
and limits raised to 1048576) both fail in this sandbox: crun refuses hybrid cgroup hierarchies and
the limits need CAP_SYS_RESOURCE (deploy/README.md, "The image"). runc with the limits set also runs
on an ordinary host.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from shadow.base.procs import read_json_line
from shadow.mirror.keys import KEY_FILE_NAME

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "deploy" / "image" / "build.sh"
IMAGE_UID = 65532
RUN_FLAGS = ["--runtime", "runc", "--ulimit", "nofile=16384:16384", "--ulimit", "nproc=4096:4096",
             "--network", "host", "--read-only", "--read-only-tmpfs=false"]

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1800)]


def _podman() -> str:
    exe = shutil.which("podman")
    if exe is None:
        pytest.fail("podman is missing (apt-get install -y podman mmdebstrap runc; scripts/test.sh does)")
    return exe


@pytest.fixture(scope="session")
def image(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The image build.sh makes (its base cached across sessions, its layers by podman)."""
    _podman()
    log = tmp_path_factory.mktemp("image") / "build.log"
    with log.open("w") as fh:
        res = subprocess.run([str(BUILD)], stdout=subprocess.PIPE, stderr=fh, text=True, timeout=1700)
    assert res.returncode == 0, log.read_text()[-4000:]
    tag = res.stdout.strip().splitlines()[-1]
    assert tag == subprocess.run([str(BUILD), "--print-tag"], capture_output=True, text=True).stdout.strip()
    return tag


def _inspect(ref: str, fmt: str, what: str = "image") -> str:
    res = subprocess.run([_podman(), what, "inspect", "--format", fmt, ref], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    return res.stdout.strip()


@contextmanager
def _container(image: str, cmd: Sequence[str], *extra: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """`podman run IMAGE CMD` until the block ends; yields (container name, its ready line). On exit
    `podman stop` (SIGTERM) and a clean exit of the process in the container is asserted."""
    name = f"shadow-test-{uuid.uuid4().hex[:12]}"
    argv = [_podman(), "run", "--rm", "--name", name, *RUN_FLAGS, *extra, image, *cmd]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL)
    stopped = False
    try:
        try:
            ready = read_json_line(proc, f"{cmd[0]} in {image}", 120)
        except RuntimeError as exc:
            raise AssertionError(f"{exc}: {_drain(proc)}") from None
        yield name, ready
        subprocess.run([_podman(), "stop", "--time", "20", name], capture_output=True, timeout=60)
        stopped = True
        assert proc.wait(60) == 0, _drain(proc)
    finally:
        if not stopped:
            subprocess.run([_podman(), "rm", "--force", name], capture_output=True, timeout=60)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        _drain(proc)


def _drain(proc: subprocess.Popen[str]) -> str:
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    return (err or "")[-3000:]


def test_the_image_is_non_root_with_shadow_as_entrypoint(image: str) -> None:
    assert _inspect(image, "{{.Config.User}}") == f"{IMAGE_UID}:{IMAGE_UID}"
    assert json.loads(_inspect(image, "{{json .Config.Entrypoint}}")) == ["shadow"]
    env = dict(e.split("=", 1) for e in json.loads(_inspect(image, "{{json .Config.Env}}")))
    assert env["SHADOW_STATE_DIR"] == "/var/lib/shadow"
    version = subprocess.run([_podman(), "run", "--rm", *RUN_FLAGS, image, "--version"],
                             capture_output=True, text=True, timeout=120)
    assert version.returncode == 0 and version.stdout.strip() == f"shadow {image.rsplit(':', 1)[1]}", (
        version.stdout + version.stderr)
    probe = ("import os; print(os.getuid(), os.getgid())\n"
             "for p in ('/', '/opt/shadow', '/tmp', '/var/lib/shadow'):\n"
             "    try: open(os.path.join(p, 'probe'), 'w')\n"
             "    except OSError as e: print(p, e.strerror)\n"
             "    else: print(p, 'writable')")
    res = subprocess.run([_podman(), "run", "--rm", *RUN_FLAGS, "--entrypoint", "python3", image,
                          "-c", probe], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0] == f"{IMAGE_UID} {IMAGE_UID}"
    assert lines[1:4] == ["/ Read-only file system", "/opt/shadow Read-only file system",
                          "/tmp Read-only file system"]
    assert lines[4] == "/var/lib/shadow writable"  # the image's VOLUME: podman gives it an anonymous volume


def test_fleet_and_serve_run_in_the_image_read_only_and_mirror_real_requests(
    image: str, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    if os.geteuid() == 0:
        os.chown(state, IMAGE_UID, IMAGE_UID)
    else:
        state.chmod(0o777)  # rootless podman maps the image's user to a subordinate uid
    with _container(image, ["fleet", "--decode", "2", "--slots", "4", "--port", "0"]) as (fleet, ready):
        assert _inspect(fleet, "{{.HostConfig.ReadonlyRootfs}}", "container") == "true"
        decode = ready["decode"]
        assert len(decode) == 2 and all(u.startswith("http://127.0.0.1:") for u in decode)
        serve = ["serve", "--slots", "4", "--port", "0", "--scrape-interval", "0.5",
                 "--upstream", f"d0={decode[0]}", "--upstream", f"d1={decode[1]}"]
        with _container(image, serve, "--volume", f"{state}:/var/lib/shadow") as (side, up):
            assert _inspect(side, "{{.HostConfig.ReadonlyRootfs}}", "container") == "true"
            assert _inspect(side, "{{.Config.User}}", "container") == f"{IMAGE_UID}:{IMAGE_UID}"
            for name in ("d0", "d1", "d0"):
                client = openai.OpenAI(base_url=up["taps"][name] + "/v1", api_key="x", max_retries=0,
                                       timeout=120)
                out = client.chat.completions.create(
                    model="sim-llm", messages=[{"role": "user", "content": f"hello {name}"}],
                    max_tokens=5, stream=False, extra_body={"ignore_eos": True})
                assert out.choices[0].message.content
            report = httpx.get(up["api"] + "/v1/report", params={"drain": 1}, timeout=120).json()
            assert report["workers"] == ["d0", "d1"]
            assert report["lanes"]["actual"]["requests_finished"] == 3, report["lanes"]["actual"]
            metrics = httpx.get(up["api"] + "/metrics", timeout=30).text
            assert "shadow_lane_requests_finished_total" in metrics
        key = state / KEY_FILE_NAME  # written by the container's non-root user into the state directory
        assert len(bytes.fromhex(key.read_text().strip())) == 32 and key.stat().st_mode & 0o777 == 0o600
        if os.geteuid() == 0:
            assert key.stat().st_uid == IMAGE_UID

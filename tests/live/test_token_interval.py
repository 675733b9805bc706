"""`--token-interval` in `shadow serve`: the lanes are told the Tokens come held (no steps measured in
the streams, said in the report), and a central analysis fed a node's held events over the event
API's NDJSON reports what the one-process run reports (bench/bench_analysis.py --stage's check)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from shadow.app.serve import ServeConfig, ServeService
from shadow.mirror.config import MirrorConfig

ROOT = Path(__file__).resolve().parents[2]


def _service(interval: float) -> ServeService:
    workers = {"d0": "http://127.0.0.1:9", "d1": "http://127.0.0.1:10"}
    tap = MirrorConfig(workers, slots=8, scrape_interval_s=0, token_interval_s=interval)
    return ServeService(ServeConfig(tap=tap))


def test_held_tokens_turn_the_stream_steps_off_and_the_report_says_so() -> None:
    held, plain = _service(0.5), _service(0.0)
    assert held.tap.mirror.hold is not None and plain.tap.mirror.hold is None
    assert not held.live.driver.table.stream_steps and plain.live.driver.table.stream_steps
    say = "--token-interval"
    assert any(say in w for w in held.live.report()["warnings"])
    assert not any(say in w for w in plain.live.report()["warnings"])


def test_a_negative_interval_is_refused_with_its_reason() -> None:
    with pytest.raises(ValueError, match="--token-interval must be >= 0 s"):
        MirrorConfig({"d0": "http://127.0.0.1:9"}, token_interval_s=-1.0).check()


@pytest.mark.parametrize(("fleet", "shards"), [("8x32", "0"), ("16x64", "1")])
def test_the_centre_fed_by_a_node_reports_what_one_process_reports(fleet: str, shards: str) -> None:
    # a small fleet, long enough for the lanes (2 s behind) to run; the bench exits 1 on any
    # difference. With the policies' lanes in a shard process, the open requests are the most any
    # process keeps (16x64: the central table alone kept 1,030 where one process keeps 1,031)
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_analysis.py"), "--fleet", fleet, "--seconds", "4",
         "--token-interval", "0.5", "--stage", "--lane-shards", shards],
        capture_output=True, text=True, timeout=600, cwd=ROOT, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "report figures equal" in out.stdout
    assert "NDJSON lines rejected 0" in out.stdout

"""A real vllm-router (plain and P/D mode) pointed at taps in front of the simulated fleet: every
routing decision is recovered, and mirrored active counts match the fleet's own at quiescent points."""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from shadow.base.tools import find_executable
from shadow.contracts.events import Route
from shadow.contracts.ids import request_hash
from shadow.fleet import FleetConfig
from shadow.mirror.config import MirrorConfig
from shadow.vllm.metrics import parse_vllm_metrics
from tests.harness import FleetThread, TapThread

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
MODEL = "sim-llm"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(url: str, proc: subprocess.Popen[bytes], timeout: float = 30) -> bool:
    """True once url answers 200; False as soon as proc has exited (its log says why)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(url)


@pytest.fixture
def router(tmp_path: Path) -> Iterator[Any]:
    procs: list[tuple[subprocess.Popen[bytes], Any]] = []

    def start(args: list[str]) -> tuple[str, str]:
        """The router on two free ports; started again on new ones only when another process took a
        port between our probe and its bind (xdist workers run beside it)."""
        exe = find_executable("vllm-router")
        if exe is None:
            pytest.fail("vllm-router is not installed (pip install -e '.[test]')")
        for attempt in range(3):
            port, mport = _free_port(), _free_port()
            path = tmp_path / f"router{len(procs)}.log"
            log = path.open("wb")
            p = subprocess.Popen(
                [
                    exe,
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    *args,
                    "--prometheus-host",
                    "127.0.0.1",
                    "--prometheus-port",
                    str(mport),
                    "--worker-startup-check-interval",
                    "1",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
            procs.append((p, log))
            url = f"http://127.0.0.1:{port}"
            try:
                if _wait(url + "/health", p):
                    return url, f"http://127.0.0.1:{mport}/metrics"
            except TimeoutError:
                pytest.fail(path.read_text()[-2000:])
            text = path.read_text()
            if "Address already in use" not in text or attempt == 2:
                pytest.fail(text[-2000:])
        raise AssertionError("unreachable")

    yield start
    for p, log in procs:
        p.terminate()
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
        log.close()


def _decisions(metrics_url: str) -> dict[str, float]:
    """vllm_router_policy_decisions_total summed per worker URL."""
    out: dict[str, float] = {}
    for line in httpx.get(metrics_url).text.splitlines():
        if line.startswith("vllm_router_policy_decisions_total{"):
            labels, _, value = line.rpartition(" ")
            worker = labels.split('worker="', 1)[1].split('"', 1)[0]
            out[worker.rstrip("/")] = out.get(worker.rstrip("/"), 0.0) + float(value)
    return out


def _run_requests(url: str, n: int, max_tokens: int, workers: int = 6) -> list[str]:
    client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)

    def one(i: int) -> str:
        kw: dict[str, Any] = {
            "model": MODEL,
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            "extra_body": {"ignore_eos": True},
        }
        if i % 2:
            s = client.chat.completions.create(messages=[{"role": "user", "content": "w " * (5 + i)}], **kw)
        else:
            s = client.completions.create(prompt="w " * (5 + i), **kw)
        ids = [ch.id for ch in s]
        return ids[0]

    with ThreadPoolExecutor(workers) as ex:
        return list(ex.map(one, range(n)))


def _running(urls: dict[str, str]) -> dict[str, float]:
    out = {}
    for name, u in urls.items():
        load = parse_vllm_metrics(httpx.get(u + "/metrics").text)
        out[name] = (load.running or 0.0) + (load.waiting or 0.0)
    return out


def _quiescent_check(t: TapThread, decode: dict[str, str], url: str, n: int) -> None:
    """While `n` streams are mid-decode (no arrivals, no ends), mirrored active == fleet running.

    The streams run until the check is done (then the client closes them and the workers abort
    them), so the quiescent point lasts as long as the check needs, however slow the machine.
    """
    client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    stop = threading.Event()

    def hold(i: int) -> None:
        s = client.completions.create(
            model=MODEL, prompt="w " * (5 + i), max_tokens=16_000, stream=True,
            extra_body={"ignore_eos": True},
        )
        with s:
            for _ in s:
                if stop.is_set():
                    break

    threads = [threading.Thread(target=hold, args=(i,), daemon=True) for i in range(n)]
    for th in threads:
        th.start()
    deadline = time.monotonic() + 60
    while True:
        fleet = _running(decode)
        mirrored = t.sync(lambda: {w: t.svc.state.active(w) for w in decode})
        if sum(fleet.values()) == n and fleet == {w: float(v) for w, v in mirrored.items()}:
            break
        assert time.monotonic() < deadline, (fleet, mirrored)
        time.sleep(0.1)
    stop.set()
    for th in threads:
        th.join(30)
    assert t.wait_for(lambda: t.svc.state.active() == 0, timeout=30)
    deadline = time.monotonic() + 30
    while _running(decode) != {w: 0.0 for w in decode}:  # the workers abort the closed streams
        assert time.monotonic() < deadline, _running(decode)
        time.sleep(0.1)


def test_plain_mode_decisions_recovered_and_active_counts_match(router: Any) -> None:
    with FleetThread(FleetConfig(prefill=0, decode=3, base_port=0, time_scale=0.25)) as ft:
        decode = {f"d{i}": u for i, u in enumerate(ft.decode_urls)}
        with TapThread(MirrorConfig(decode, scrape_interval_s=0.2)) as t:
            taps = t.ready["taps"]
            url, murl = router(["--worker-urls", *taps.values(), "--policy", "random"])
            _run_requests(url, 24, 4)
            assert t.wait_for(lambda: t.svc.state.live() == 0 and not len(t.svc.queue))
            dec = _decisions(murl)
            st_ = httpx.get(t.ready["api"] + "/v1/state").json()
            for name, tap_url in taps.items():
                w = st_["workers"][name]
                assert dec.get(tap_url, 0) == w["finished"] + w["cancelled"], (name, dec, w)
                served = parse_vllm_metrics(httpx.get(decode[name] + "/metrics").text)
                assert served.running == 0
            assert sum(st_["workers"][n]["finished"] for n in taps) == 24
            assert st_["phantoms"] == 0
            rec = t.svc.reconciler
            assert rec is not None
            assert t.wait_for(lambda: all(w.drift_requests == 0 for w in rec.workers.values()), timeout=3)
            _quiescent_check(t, decode, url, 8)


def test_pd_mode_decisions_recovered_from_taps(router: Any) -> None:
    with FleetThread(FleetConfig(prefill=1, decode=2, base_port=0, time_scale=0.25)) as ft:
        decode = {f"d{i}": u for i, u in enumerate(ft.decode_urls)}
        cfg = MirrorConfig(decode, prefill={"p0": ft.prefill_urls[0]}, scrape_interval_s=0.2)
        with TapThread(cfg) as t:
            taps = t.ready["taps"]
            args = ["--vllm-pd-disaggregation", "--prefill", taps["p0"]]
            for n in decode:
                args += ["--decode", taps[n]]
            url, murl = router([*args, "--policy", "random"])
            ids = _run_requests(url, 20, 4)
            assert t.wait_for(lambda: t.svc.state.live() == 0 and not len(t.svc.queue))
            routes = t.sync(
                lambda: {ev.request_id: ev for _, ev in t.svc.mirror.recent if isinstance(ev, Route)}
            )
            assert len(routes) == 20
            by_addr = {u.split("//", 1)[1]: n for n, u in taps.items()}
            for rid in ids:  # a chunk's id: the X-Request-Id the worker got, after cmpl- or chatcmpl-
                sent = rid.split("-", 1)[1]
                mine = routes[request_hash(sent)]  # the mirror knows a request by its id's hash
                # the router names its decode choice in the request id; the tap that saw the leg agrees
                addr = sent.split("___decode_addr_", 1)[1].rsplit("_", 1)[0]
                assert by_addr[addr] == mine.worker
                assert mine.prompt_tokens and mine.prompt_tokens > 0  # from the paired prefill leg
            dec = _decisions(murl)
            st_ = httpx.get(t.ready["api"] + "/v1/state").json()
            for n in decode:
                rank = httpx.get(decode[n] + "/metrics").text
                served = sum(
                    float(x.rsplit(" ", 1)[1])
                    for x in rank.splitlines()
                    if x.startswith("vllm:request_success_total{")
                )
                assert served == st_["workers"][n]["finished"], (n, served, st_["workers"])
                assert dec.get(taps[n], 0) == st_["workers"][n]["finished"], (n, dec, taps, st_["workers"])
            assert dec.get(taps["p0"], 0) in (0, 20)  # some versions count prefill picks too
            legs = t.sync(
                lambda: t.svc.registry.get_sample_value(
                    "shadow_mirror_legs_total", {"worker": "p0", "leg": "prefill"}
                )
            )
            assert legs == 20
            _quiescent_check(t, decode, url, 6)


def test_front_mode_reads_decisions_from_vllm_router_responses(router: Any) -> None:
    """A tap in front of a real vllm-router (P/D) recovers every decode decision from its request ids."""
    with FleetThread(FleetConfig(prefill=1, decode=3, base_port=0, time_scale=0.25)) as ft:
        decode = {f"d{i}": u for i, u in enumerate(ft.decode_urls)}
        args = ["--vllm-pd-disaggregation", "--prefill", ft.prefill_urls[0]]
        for u in decode.values():
            args += ["--decode", u]
        url, murl = router([*args, "--policy", "random"])
        cfg = MirrorConfig({}, front={"router": url}, workers=decode, scrape_interval_s=0.2)
        with TapThread(cfg) as t:
            front = t.ready["taps"]["router"]
            _run_requests(front, 24, 4)
            assert t.wait_for(lambda: t.svc.state.live() == 0 and not len(t.svc.queue))
            st_ = httpx.get(t.ready["api"] + "/v1/state").json()
            dec = _decisions(murl)
            for n, u in decode.items():
                rank = httpx.get(u + "/metrics").text
                served = sum(
                    float(x.rsplit(" ", 1)[1])
                    for x in rank.splitlines()
                    if x.startswith("vllm:request_success_total{")
                )
                assert served == st_["workers"][n]["finished"], (n, served, st_["workers"])
                assert dec.get(u.rstrip("/"), 0) == served, (n, dec)
            assert sum(st_["workers"][n]["finished"] for n in decode) == 24
            assert st_["phantoms"] == 0
            dropped = t.sync(lambda: dict(t.svc.mirror.dropped))
            assert "no_routing_decision" not in dropped and "unknown_decode_address" not in dropped
            _quiescent_check(t, decode, front, 6)

"""Fallback on a killed real rank: `shadow serve --active` routes plain requests over two real vLLM
decode servers (the tier's DP server and one started here; not the probe server, whose steps
the probe tests count); the one started here is killed
(SIGKILL to its whole process group) under `openai` traffic; the controller trips `worker_down`
within 3 scrapes of its /metrics refusing connections, and every request sent after the trip
completes with exactly its max_tokens (routed to the rank that is up)."""

from __future__ import annotations

import asyncio
import signal
import socket
import threading
import urllib.parse

import openai

from shadow.realvllm.launcher import VllmFleet, VllmFleetConfig
from tests.active.procs import shadow_process
from tests.active.test_fallback_e2e import last, mode, scrapes, wait_for
from tests.active.test_fallback_proxy import Traffic as ClosedLoop
from tests.realvllm.conftest import MODEL_NAME, Tier


def refuses(url: str) -> bool:
    """True when a connection to `url`'s host and port is refused (nothing listens there now)."""
    parts = urllib.parse.urlsplit(url)
    try:
        socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 80), timeout=5).close()
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
    return False


class Traffic(ClosedLoop):
    """`streams` concurrent openai streams in a closed loop until stopped; a request counts as ok
    when its usage says exactly max_tokens (a real engine merges tokens into fewer chunks), filed
    by whether it started after `after` was set."""

    def __init__(self, url: str, streams: int = 6, max_tokens: int = 12) -> None:
        super().__init__(url, streams)
        self.max_tokens = max_tokens
        self.ok = self.ok_after = self.failed_after = 0
        self.after = threading.Event()

    async def _run(self) -> None:
        client = openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="x", max_retries=0, timeout=120)

        async def loop(i: int) -> None:
            while not self.stop.is_set():
                late = self.after.is_set()
                try:
                    s = await client.completions.create(
                        model=MODEL_NAME, prompt=f"fallback {i} " * (3 + i), max_tokens=self.max_tokens,
                        temperature=0, stream=True, stream_options={"include_usage": True},
                        extra_body={"ignore_eos": True})
                    used = [ch.usage.completion_tokens async for ch in s if ch.usage is not None]
                    good = used == [self.max_tokens]
                except openai.OpenAIError:
                    good = False
                if late:
                    self.ok_after += good
                    self.failed_after += not good
                else:
                    self.ok += good
                    self.failed += not good

        await asyncio.gather(*(loop(i) for i in range(self.streams)))
        await client.close()


def test_a_killed_real_rank_trips_worker_down_and_the_traffic_moves_to_the_other(tier: Tier) -> None:
    victim = VllmFleet(VllmFleetConfig(decode=1, model_path=tier.model, cores=(1,),
                                       log_dir=tier.logs / "victim"), log=lambda msg: None)
    victim.log_dir.mkdir(parents=True, exist_ok=True)
    victim.start()
    try:
        args = ["serve", "--active", "--active-policy", "jsq-bytes", "--mode", "active", "--slots", "64",
                "--scrape-interval", "0.5", "--mode-check-interval", "0.05", "--holddown", "300",
                "--holddown-max", "600", "--trip-upstream-min-calls", "100000", "--oracle-interval", "0",
                # worker_down is under test: the client-felt trips (the cut streams of the killed
                # rank) would otherwise race it, and win on a loaded host (.ci/run)
                "--trip-client-min-requests", "100000", "--trip-slo-min-requests", "100000",
                "--upstream", f"d0={tier.drop.decode_urls[0]}", "--upstream", f"d1={victim.decode_urls[0]}"]
        with shadow_process(args, timeout=120) as (_, ready):
            api, proxy = ready["api"], ready["active"]
            wait_for(lambda: mode(api)["current"] == "active" and scrapes(api) >= 2, "active, scraped", 120)
            with Traffic(proxy) as traffic:
                wait_for(lambda: traffic.ok >= 12, "traffic flowing on both ranks", 300)
                victim.servers[0].signal_group(signal.SIGKILL)
                # the bound counts from when its /metrics refuses connections: a scrape can still
                # succeed between the signal and the process's exit (a loaded host, a big process)
                wait_for(lambda: refuses(victim.decode_urls[0]), "the killed rank's port closed", 60)
                s0 = scrapes(api)
                wait_for(lambda: mode(api)["current"] == "fallback", "fallback on the killed rank", 120)
                trip = last(api, "worker_down")
                assert trip is not None and "d1" in trip["detail"] and trip["scrapes"] <= s0 + 3, (trip, s0)
                traffic.after.set()
                wait_for(lambda: traffic.ok_after >= 24, "requests completing after the trip", 300)
            assert traffic.failed_after == 0, (traffic.ok_after, traffic.failed_after)
    finally:
        victim.stop()

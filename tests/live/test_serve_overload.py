"""`shadow serve` whose lanes cannot keep up: the taps keep relaying, the lanes drop and count.

A `shadow fleet` process of four decode ranks, `shadow serve`'s taps in front of them with a live
queue of 64 events, and the lanes' worker held (the test holds the lock the lane thread takes for
each batch, as a lane too slow for the traffic would). 40 concurrent streams through the taps with
the official openai client must all complete with exactly their `max_tokens`, while the lanes'
queue stays at its bound and the overflow is counted, in the report and on /metrics.
"""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from shadow.app.serve import ServeConfig
from shadow.mirror.config import MirrorConfig
from tests.harness import ServeThread
from tests.live.test_live_fleet import _stop, start_fleet

G, B, QUEUE, STREAMS, TOKENS = 4, 16, 64, 40, 30


def _stream(base: str, model: str, i: int) -> int:
    client = openai.OpenAI(base_url=base + "/v1", api_key="EMPTY", max_retries=0, timeout=60)
    n = 0
    for chunk in client.completions.create(
        model=model,
        prompt=" ".join(f"w{i}" for _ in range(50)),
        max_tokens=TOKENS,
        stream=True,
        extra_body={"ignore_eos": True},
    ):
        if chunk.choices and chunk.choices[0].text:
            n += 1
    return n


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_lanes_that_cannot_keep_up_drop_and_count_while_every_stream_completes(tmp_path: Path) -> None:
    fleet, urls = start_fleet(tmp_path, prefill=0)
    try:
        names = [f"d{g}" for g in range(G)]
        tap = MirrorConfig(dict(zip(names, urls["decode"], strict=True)), slots=B, scrape_interval_s=0)
        with ServeThread(ServeConfig(tap=tap, live_queue_size=QUEUE)) as s:
            taps, api, live = s.ready["taps"], s.ready["api"], s.serve.live
            model = httpx.get(urls["decode"][0] + "/v1/models", timeout=5).json()["data"][0]["id"]
            with live._lock:  # the lanes stall; nothing on the relay side may notice
                with ThreadPoolExecutor(STREAMS) as pool:
                    counts = list(pool.map(lambda i: _stream(taps[names[i % G]], model, i), range(STREAMS)))
                assert counts == [TOKENS] * STREAMS
                # The count is final only once the mirror has applied every stream's end: a client
                # has its last chunk before the tap offers the end, and on a busy host the analysis
                # is behind, so events still reach the full queue (and count) after the streams.
                def ended() -> bool:
                    return sum(w.finished for w in s.svc.state.workers.values()) == STREAMS

                assert s.wait_for(ended, timeout=60), "the mirror never saw every stream end"
                assert s.settle(60)
                assert live.dropped["queue_full"] > 0
                assert len(live._queue) <= QUEUE
                dropped = live.dropped["queue_full"]
            deadline = time.monotonic() + 30
            while True:  # the lanes resume; the drops are published on /metrics
                text = httpx.get(api + "/metrics", timeout=5).text
                m = re.search(r'^shadow_live_events_dropped_total\{reason="queue_full"\} (\S+)', text, re.M)
                if m and float(m.group(1)) == dropped:
                    break
                assert time.monotonic() < deadline, "queue_full drops never reached /metrics"
                time.sleep(0.05)
            report = httpx.get(api + "/v1/report", timeout=30).json()
            assert report["events"]["dropped"]["queue_full"] == dropped
            assert report["events"]["queue_capacity"] == QUEUE
            assert any("dropped" in w for w in report["warnings"])
    finally:
        _stop(fleet)

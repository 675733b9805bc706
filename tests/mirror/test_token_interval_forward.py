"""A node's analysis with `--token-interval` forwarding to a central one over real HTTP: the centre
gets one Token per stream per interval (not one per chunk) and ends with the node's state."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai

from shadow.mirror.config import MirrorConfig
from tests.harness import TapThread
from tests.mirror.stub_worker import ThreadServer, create_stub

STREAMS, TOKENS = 4, 30


def _stream(base: str) -> int:
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
    chunks = client.completions.create(model="m", prompt="hello", max_tokens=TOKENS, stream=True)
    return sum(1 for c in chunks if c.choices and c.choices[0].text)


async def _flush(em: Any) -> None:
    await em.flush()


def test_the_centre_takes_held_tokens_and_ends_with_the_nodes_state() -> None:
    with ThreadServer(create_stub("d0", tokens=TOKENS, step_s=0.01)) as up:
        centre_cfg = MirrorConfig({"d0": up.url}, scrape_interval_s=0, events_token="tok")
        with TapThread(centre_cfg) as centre:
            node_cfg = MirrorConfig({"d0": up.url}, scrape_interval_s=0, forward_to=centre.ready["api"],
                                    forward_token="tok", token_interval_s=0.2)
            with TapThread(node_cfg) as node:
                t0 = time.monotonic()
                with ThreadPoolExecutor(STREAMS) as pool:
                    counts = list(pool.map(_stream, [node.ready["taps"]["d0"]] * STREAMS))
                spanned = time.monotonic() - t0
                assert counts == [TOKENS] * STREAMS  # the clients got every token
                assert node.settle(60)
                em = node.svc.emitter
                assert node.call(_flush(em)) is None
                def finished() -> int:  # on the centre's analysis loop
                    return int(centre.svc.state.snapshot(0)["workers"]["d0"]["finished"])

                assert centre.wait_for(lambda: finished() == STREAMS, 60), centre.sync(finished)
                hold = node.sync(lambda: node.svc.mirror.hold)
                assert hold is not None and node.sync(len, hold) == 0  # every stream's end took its Token
                node_tokens = node.sync(lambda: node.svc.mirror.events.get(("tap", "token"), 0))
                centre_tokens = centre.sync(lambda: centre.svc.mirror.events.get(("api", "token"), 0))
                # a stream's Tokens: its first, then one per 0.2 s interval its chunks fell in, not one
                # per chunk; every chunk that advanced a count is either passed on or coalesced
                intervals = int(spanned / 0.2) + 2  # (a span meets at most this many intervals)
                assert STREAMS <= centre_tokens == node_tokens <= STREAMS * (1 + intervals), spanned
                coalesced = node.sync(lambda: hold.coalesced)
                assert coalesced > 0 and coalesced + node_tokens >= STREAMS * (TOKENS - 1)
                metrics = httpx.get(node.ready["api"] + "/metrics").text
                assert f"shadow_mirror_tokens_coalesced_total {float(coalesced)}" in metrics
                assert "shadow_mirror_tokens_held 0.0" in metrics
                ends = [float(line.split()[1]) for line in metrics.splitlines()
                        if line.startswith("shadow_mirror_step_ends_total ")]
                assert ends and ends[0] > 0, "the node found step ends in its streams and carried them"
                node_w = node.sync(lambda: node.svc.state.snapshot(0)["workers"]["d0"])
                centre_w = centre.sync(lambda: centre.svc.state.snapshot(0)["workers"]["d0"])
                assert {k: centre_w[k] for k in ("active", "kv_tokens", "finished")} == {
                    k: node_w[k] for k in ("active", "kv_tokens", "finished")}

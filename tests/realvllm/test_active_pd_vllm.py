"""`shadow serve --active` in front of a real vLLM P/D pair (NixlConnector where NIXL imports, else
ExampleConnector): 50 concurrent `openai` streams each get exactly their max_tokens, every prompt
is prefilled once on the prefill server, and the decode server takes the prompts' KV over the
connector (the handles the prefill answered with, passed through) instead of computing it again."""

from __future__ import annotations

import asyncio

import openai

from shadow.base.procs import Child, shadow_argv
from shadow.realvllm.launcher import nixl_available
from tests.realvllm.conftest import MODEL_NAME, Tier
from tests.realvllm.helpers import metric


def test_fifty_streams_through_the_active_proxy_in_front_of_a_real_pd_pair(tier: Tier) -> None:
    (p_url,), (d_url,) = tier.pd_ready["prefill"], tier.pd_ready["decode"]
    serve = Child("shadow serve --active", shadow_argv(
        "serve", "--upstream", f"d0={d_url}", "--prefill", f"p0={p_url}", "--slots", "64",
        "--active", "--active-policy", "jsq-bytes", "--mode", "active", "--pin-mode", "--admin-token",
        "tier-admin-token-0123456789",
        "--scrape-interval", "0.5", "--oracle-interval", "0"), tier.logs / "serve-active.log")
    try:
        url = str(serve.ready["active"])
        n = 50
        prefills = metric(p_url, "vllm:request_success_total", finished_reason="length")
        decodes = metric(d_url, "vllm:request_success_total", finished_reason="length")
        moved = metric(d_url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
        local = metric(d_url, "vllm:prompt_tokens_by_source_total", source="local_compute")
        prompts = [" ".join(f"p{i}w{j % 89}" for j in range(130 + 7 * i)) for i in range(n)]

        async def run() -> list[tuple[int, int]]:
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)

            async def one(i: int) -> tuple[int, int]:
                stream = await client.completions.create(
                    model=MODEL_NAME, prompt=prompts[i], max_tokens=8 + i % 9, temperature=0, stream=True,
                    stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
                usage = 0
                async for ch in stream:
                    if ch.usage is not None:
                        usage = ch.usage.completion_tokens
                return usage, 8 + i % 9

            try:
                return list(await asyncio.gather(*(one(i) for i in range(n))))
            finally:
                await client.close()

        got = asyncio.run(run())
        assert [u for u, _ in got] == [want for _, want in got], "each stream exactly its max_tokens"
        # every prompt prefilled once (its one token: "length"), again only for a flow retried after
        # its decode leg answered an error (the retry runs a fresh prefill), and decoded to its end once
        prefilled = metric(p_url, "vllm:request_success_total", finished_reason="length") - prefills
        decoded = metric(d_url, "vllm:request_success_total", finished_reason="length") - decodes
        api = str(serve.ready["api"])
        retried = metric(api, "shadow_router_retries_total", leg="decode")
        seen = {"prefilled": prefilled, "decoded": decoded, "decode retries": retried,
                "prefill aborts": metric(p_url, "vllm:request_success_total", finished_reason="abort"),
                "decode aborts": metric(d_url, "vllm:request_success_total", finished_reason="abort"),
                "upstream errors": metric(api, "shadow_router_upstream_errors_total")}
        assert n <= prefilled <= n + retried and decoded == n, seen
        moved = metric(d_url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") - moved
        local = metric(d_url, "vllm:prompt_tokens_by_source_total", source="local_compute") - local
        # every prompt spans at least one whole 128-token block: each decode took KV over the connector
        assert moved >= 128 * n, (moved, local)
        if nixl_available(tier.venv):
            assert local < moved, (moved, local)  # the decode server did not prefill again
    finally:
        serve.stop()

"""The two upstream legs of one P/D attempt and what they hold.

`prefill(flow, gone, exclude)`: the prefill leg (not streamed, `max_tokens=1`, `min_tokens=1`,
`kv_transfer_params.do_remote_decode`) on the prefiller the `PrefillChooser` picks; returns the KV
handle. `decode(flow, kv, gone)`: the decode leg on `flow.worker` (the client's body plus `kv`);
returns the 200 answer, its body unread. Each raises `flow.LegFailed` when it fails before the
client got a byte: retryable when the upstream never got the request, or answered 5xx/429. A KV
handle nobody will pull (`abort_kv`) is sent as `kv_transfer_params.aborted_request` with its
prefiller's next prefill leg so it frees it (`aborted`, at most `MAX_ABORTED` per prefiller).
`release_prefill`, `decode_over` and `first_token` give back what a flow holds (its prefiller's
work, its decode slot and CLIENT span, its KV transfer).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import httpx
import orjson

from shadow.active.calls import UpstreamCalls
from shadow.active.clientgone import race
from shadow.active.cohorts import client_fault
from shadow.active.dispatcher import Dispatcher
from shadow.active.flow import Flow, LegFailed
from shadow.active.ledger import Ledger
from shadow.active.prefill import PrefillChooser, Prefiller, prefill_score
from shadow.active.proxycounts import ProxyCounts
from shadow.active.upstream import Unsent
from shadow.contracts.modes import ModeSource
from shadow.telemetry.httpspans import http_client_span

PREFILL_KV_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
MAX_ABORTED = 4096  # abandoned KV handles remembered per prefiller
GATEWAY_DOWN = (502, 504)  # a decode worker's tap could not reach it: the worker is down


class Legs:
    """The prefill and decode legs over the proxy's shared pieces (see module docstring)."""

    def __init__(self, upstreams: UpstreamCalls, prefill: PrefillChooser, dispatcher: Dispatcher,
                 ledger: Ledger, counts: ProxyCounts, modes: ModeSource, decode: dict[str, str],
                 prefill_wait_s: float, clock: Callable[[], float]) -> None:
        self.upstreams, self.prefill, self.dispatcher, self.ledger = upstreams, prefill, dispatcher, ledger
        self.counts, self.metrics, self.modes, self.clock = counts, counts.metrics, modes, clock
        self.decode_names = list(decode)
        self.decode_urls = [u.rstrip("/") for u in decode.values()]
        self.prefill_wait_s = prefill_wait_s
        # KV handles nobody will pull (pool TTL, client gone), per prefiller: sent as
        # `kv_transfer_params.aborted_request` with its next prefill leg so it frees them
        self.aborted: dict[str, list[str]] = {}

    async def prefill_leg(self, flow: Flow, gone: asyncio.Future[Any], exclude: list[str]) -> dict[str, Any]:
        """The KV handle of `flow`'s prompt, prefilled on a prefiller not in `exclude`."""
        cost = prefill_score(len(flow.raw))
        try:
            p = await race(self.prefill.acquire(cost, exclude, self.prefill_wait_s), gone)
        except TimeoutError:
            raise LegFailed.ours(
                503, "every prefiller is over its KV budget", "prefill_kv", False, "pool"
            ) from None
        flow.prefiller, flow.prefill_cost = p, cost
        client = self.upstreams.client(p.url)
        call = http_client_span(self.upstreams.tracer, "POST", p.url + flow.path, p.name, "prefill")
        body = orjson.dumps(self._prefill_body(flow, p))
        req = client.build_request("POST", p.url + flow.path, content=body,
                                   headers=self.upstreams.headers(flow.rid, call))
        try:
            r = await self.upstreams.send(call, client, req, gone)
        except (Unsent, httpx.HTTPError) as exc:
            self.counts.upstream_failed(p.name, "prefill")
            p.down = True
            self.release_prefill(flow)
            if isinstance(exc, Unsent):  # it never got the whole request: another prefiller may
                raise LegFailed.ours(
                    502, f"prefill {p.name} unreachable: {type(exc.cause).__name__}", "prefill_unreachable",
                    True, "prefill", p.name,
                ) from None
            raise LegFailed.ours(  # written: it may be running it (and hold its KV), never sent again
                502, f"prefill {p.name} failed before answering: {type(exc).__name__}", "prefill_no_answer",
                False, "prefill", p.name,
            ) from None
        except BaseException:
            self.release_prefill(flow)
            raise
        return self._prefilled(flow, p, r)

    def _prefill_body(self, flow: Flow, p: Prefiller) -> dict[str, Any]:
        """The prefill leg's body: the client's, not streamed, one token, asking for a KV handle."""
        leg = dict(flow.body)
        leg.pop("stream_options", None)
        kvp = dict(PREFILL_KV_PARAMS)
        aborted = self.aborted.pop(p.name, None)
        if aborted:
            kvp["aborted_request"] = aborted
        leg.update(stream=False, max_tokens=1, min_tokens=1, kv_transfer_params=kvp)
        if "max_completion_tokens" in leg:
            leg["max_completion_tokens"] = 1
        return leg

    def _prefilled(self, flow: Flow, p: Prefiller, r: httpx.Response) -> dict[str, Any]:
        """The KV handle in prefiller `p`'s answer `r`, or the leg's failure."""
        ok = r.status_code == 200
        params: Any = None
        if ok:
            try:
                doc = orjson.loads(r.content)
                params = doc.get("kv_transfer_params")
                usage = doc.get("usage") or {}
                if isinstance(usage.get("prompt_tokens"), int):
                    flow.prompt_tokens = usage["prompt_tokens"]
            except (orjson.JSONDecodeError, AttributeError):
                params = None
        fault = not ok and client_fault(r.status_code)  # the request's own fault, not the prefiller's
        self.modes.on_upstream(p.name, "prefill", (ok and isinstance(params, dict)) or fault)
        if ok and isinstance(params, dict):
            p.down = False
            flow.kv_from = p.name
            return params
        if not ok and not fault:
            self.metrics.upstream_errors.labels("prefill", p.name).inc()
        self.release_prefill(flow)
        if ok:
            raise LegFailed.ours(
                502, f"prefill {p.name} returned no kv_transfer_params", "prefill_bad_response", False,
                "prefill", p.name,
            )
        p.down = r.status_code >= 500
        raise LegFailed(
            r.status_code,
            r.content,
            r.headers.get("content-type", "application/json"),
            r.status_code >= 500 or r.status_code == 429,
            "prefill",
            p.name,
        )

    def abort_kv(self, flow: Flow, kv: dict[str, Any] | None) -> None:
        """`kv` will never be pulled: its prefiller is told with its next prefill leg."""
        key = kv.get("remote_request_id") if kv else None
        if isinstance(key, str) and flow.kv_from:
            pending = self.aborted.setdefault(flow.kv_from, [])
            pending.append(key)
            del pending[:-MAX_ABORTED]

    def release_prefill(self, flow: Flow) -> None:
        """`flow`'s prefill work is over (done, failed, or its KV pulled)."""
        if flow.prefiller is not None:
            self.prefill.release(flow.prefiller, flow.prefill_cost)
            flow.prefiller = None

    async def decode_leg(
        self, flow: Flow, kv: dict[str, Any] | None, gone: asyncio.Future[Any]
    ) -> httpx.Response:
        """The decode worker `flow.worker`'s 200 answer to `flow` (+ `kv`), its body unread."""
        g = flow.worker
        name, url = self.decode_names[g], self.decode_urls[g]
        self.metrics.inflight.labels("decode", name).set(self.ledger.outstanding[g])
        if kv is None:
            payload = flow.raw
        else:
            body = dict(flow.body)
            body["kv_transfer_params"] = kv
            payload = orjson.dumps(body)
        client = self.upstreams.client(url)
        call = http_client_span(self.upstreams.tracer, "POST", url + flow.path, name, "decode")
        req = client.build_request("POST", url + flow.path, content=payload,
                                   headers=self.upstreams.headers(flow.rid, call))
        try:
            upstream = await self.upstreams.send(call, client, req, gone, stream=True)
            flow.call = call
        except Unsent as u:  # the worker never got the whole request: try again, same KV handle
            self.decode_over(flow, None)
            self.ledger.unreachable(g, self.clock())  # (elsewhere, while it stays down)
            self.counts.upstream_failed(name, "decode")
            raise LegFailed.ours(
                502, f"decode {name} unreachable: {type(u.cause).__name__}", "decode_unreachable", True,
                "decode", name,
            ).holding(kv) from None
        except httpx.HTTPError as exc:  # written: the worker may be running it, never sent again
            self.decode_over(flow, None)
            self.counts.upstream_failed(name, "decode")
            raise LegFailed.ours(
                502, f"decode {name} failed before answering: {type(exc).__name__}", "decode_no_answer",
                False, "decode", name,
            ) from None
        except BaseException:
            self.decode_over(flow, None)
            raise
        return await self._decoding(flow, upstream)

    async def _decoding(self, flow: Flow, upstream: httpx.Response) -> httpx.Response:
        """`upstream` when the worker answered 200, else the leg's failure (its body read)."""
        g = flow.worker
        name = self.decode_names[g]
        status = upstream.status_code
        if status in GATEWAY_DOWN:  # its tap could not reach it
            self.ledger.unreachable(g, self.clock())
        else:
            self.ledger.reached(g)
        if status == 200:
            self.modes.on_upstream(name, "decode", True)
            return upstream
        try:
            content = await upstream.aread()
        except httpx.HTTPError:
            content = b""
        finally:
            await upstream.aclose()
        self.decode_over(flow, None)
        if client_fault(status):  # the request's own fault: the worker is fine
            self.modes.on_upstream(name, "decode", True)
        else:
            self.counts.upstream_failed(name, "decode")
        # The worker answered, so it had the KV handle (it may have pulled or dropped the blocks):
        # a retry runs the whole flow, with a fresh prefill.
        raise LegFailed(
            upstream.status_code,
            content,
            upstream.headers.get("content-type", "application/json"),
            upstream.status_code >= 500 or upstream.status_code == 429,
            "decode",
            name,
        )

    def decode_over(self, flow: Flow, output_tokens: int | None) -> None:
        """`flow`'s decode call is over: its CLIENT span ends, its slot is released."""
        call, flow.call = flow.call, None
        if call is not None:
            call.end()
        self.dispatcher.released(flow.rid, output_tokens)
        if flow.worker >= 0:
            self.metrics.inflight.labels("decode", self.decode_names[flow.worker]).set(
                self.ledger.outstanding[flow.worker]
            )

    def first_token(self, flow: Flow, t: float) -> None:
        """`flow`'s decode answer began at `t`: the decode pulled the KV."""
        self.dispatcher.transfer_done(flow.rid)
        self.release_prefill(flow)
        self.metrics.kv_transfer.observe(max(0.0, t - flow.dispatched_at))

    def worker_name(self, flow: Flow) -> str:
        """The decode worker serving `flow` ("router" before one was chosen, as the counts name it)."""
        return self.decode_names[flow.worker] if flow.worker >= 0 else "router"

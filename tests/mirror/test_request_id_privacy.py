"""A client's `X-Request-Id` is the client's: shadow forwards it upstream unchanged but keeps only
its hash (`contracts.ids.request_hash`). Issue 37: the mirror knew a request by the id itself, so
it appeared in the API, the recording and the mirrored-request spans (next to its hash).

`shadow serve --active` in mode shadow with a recording, its tap group in a state directory, spans
exported to a loopback OTLP receiver: one stream through the proxy (its id reaches the front tap
as sent) and one straight to a decode tap, each with a distinctive id. Neither id appears in the
API's answers, the recording, the logs, any file of the state directory or any span; the taps'
spans and the recording carry their hashes; the worker got the id as sent.
"""

from __future__ import annotations

import secrets
from pathlib import Path

import httpx
import openai
import pytest

from shadow.active.ledger import MirrorSource
from shadow.contracts.events import Arrive, Finish, Route
from shadow.contracts.ids import request_hash
from shadow.mirror.state import MirrorState
from shadow.telemetry import attrs
from tests.telemetry.active_stack import active_stack
from tests.telemetry.servers import OtlpReceiver, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def _values(span: object) -> list[str]:
    return [str(a.value) for a in span.attributes]  # type: ignore[attr-defined]


def test_a_clients_request_id_is_kept_only_as_its_hash(tmp_path: Path) -> None:
    ids = {"proxy": "wombat-id-" + secrets.token_hex(6), "tap": "quoll-id-" + secrets.token_hex(6)}
    record, state = tmp_path / "session.jsonl", tmp_path / "state"
    rx = OtlpReceiver()
    env = {"OTEL_SDK_DISABLED": "false", "OTEL_TRACES_EXPORTER": "otlp",
           "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_EXPORTER_OTLP_ENDPOINT": rx.endpoint,
           "OTEL_TRACES_SAMPLER": "always_on", "OTEL_BSP_SCHEDULE_DELAY": "200"}
    answers: list[str] = []
    try:
        with active_stack(tmp_path, prefill=0, decode=1, mode="shadow", env=env,
                          extra=("--record", str(record), "--state-dir", str(state), "--stop-taps")) as stack:
            for where, url in (("proxy", stack.front), ("tap", stack.serve["taps"]["d0"])):
                client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
                model = client.models.list().data[0].id
                raw = client.completions.with_raw_response.create(
                    model=model, prompt="p", max_tokens=3, stream=True,
                    extra_headers={"X-Request-Id": ids[where]})
                assert [c.choices[0].text for c in raw.parse()], where  # the whole stream came
                answers.append(raw.headers.get("x-request-id", ""))
                client.close()

            def tapped() -> bool:  # both requests' tap spans exported, nothing mirrored still live
                spans = {a.value.string_value for _, s in rx.spans() for a in s.attributes
                         if a.key == attrs.REQUEST_ID_HASH}
                live = httpx.get(stack.api + "/v1/state", timeout=10).json()["live"]
                return {request_hash(i) for i in ids.values()} <= spans and live == 0

            wait_for(tapped, 60, "both requests' tap spans (by their ids' hashes), none live")
            pages = {p: httpx.get(stack.api + p, timeout=10).text
                     for p in ("/v1/state", "/v1/events?after=0&limit=100000", "/v1/report", "/v1/mode",
                               "/metrics")}
    finally:
        rx.close()
    assert answers[1] == ids["tap"]  # the worker got it as sent (the fleet echoes it; the tap relays)
    assert request_hash(ids["tap"]) in pages["/v1/events?after=0&limit=100000"]  # mirrored by its hash
    assert request_hash(ids["tap"]) in record.read_text()  # and recorded so
    for where, rid in ids.items():
        for page, text in pages.items():
            assert rid not in text, (where, page)
        for f in [record, *state.rglob("*"), *tmp_path.glob("*.log")]:
            if f.is_file():
                assert rid.encode() not in f.read_bytes(), (where, f)
        for res, span in rx.spans():
            assert not [v for v in _values(span) if rid in v], (where, res, span.name)


def test_the_proxys_load_source_finds_its_requests_by_their_ids_hash() -> None:
    """The proxy sends its own id upstream and asks the mirror whether it saw the request: the
    mirror knows it by the id's hash (as the tap made it), so the lookup hashes the id."""
    state = MirrorState({"d0": ""}, slots=4)
    source = MirrorSource(state, ["d0"])
    tapped = request_hash("proxy-rid-1")
    state.apply(Arrive(tapped, 1.0, prompt_tokens=8), 1.0)
    state.apply(Route(tapped, 1.0, "d0", 8), 1.0)
    assert source.known("proxy-rid-1") and source.live("proxy-rid-1")
    assert not source.known("proxy-rid-2")
    state.apply(Finish(tapped, 2.0, "stop", 3), 2.0)
    assert source.known("proxy-rid-1") and not source.live("proxy-rid-1")

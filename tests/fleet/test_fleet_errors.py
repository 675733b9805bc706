"""Bad requests get vLLM-style error bodies with the right status, and never break the server."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from fleet_helpers import words

from shadow.fleet import FleetConfig
from tests.harness import FleetThread

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def small_fleet() -> Iterator[FleetThread]:
    cfg = FleetConfig(prefill=1, decode=1, base_port=0, time_scale=0.25, max_body_bytes=10_000,
                      max_model_len=2048)
    with FleetThread(cfg) as ft:
        yield ft


def assert_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status and isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"].endswith("Error")
    if param is not None:
        assert err["param"] == param
    return err


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_invalid_json(small_fleet: FleetThread, path: str) -> None:
    url = small_fleet.decode_urls[0] + path
    for raw in (b"{not json", b"[1, 2]", b"", b"\xff\xfe"):
        r = httpx.post(url, content=raw, headers={"content-type": "application/json"})
        assert assert_error(r, 400)["type"] == "BadRequestError"


@pytest.mark.parametrize("max_tokens", [0, -3])
def test_max_tokens_not_positive(small_fleet: FleetThread, max_tokens: int) -> None:
    url = small_fleet.decode_urls[0]
    r = httpx.post(url + "/v1/completions", json={"prompt": "a b", "max_tokens": max_tokens})
    assert_error(r, 400, "max_tokens")
    r = httpx.post(url + "/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": max_tokens})
    assert_error(r, 400, "max_completion_tokens")


def test_other_validation_errors(small_fleet: FleetThread) -> None:
    url = small_fleet.decode_urls[0]
    post = lambda path, body: httpx.post(url + path, json=body)  # noqa: E731
    assert_error(post("/v1/completions", {"prompt": "a", "max_tokens": "7"}), 400, "max_tokens")
    assert_error(post("/v1/completions", {"prompt": "a", "stream_options": {"include_usage": True}}), 400,
                 "stream_options")
    assert_error(post("/v1/completions", {"prompt": words(2000), "max_tokens": 100}), 400, "max_tokens")
    assert_error(post("/v1/completions", {"prompt": words(3000)}), 400, "prompt")
    assert_error(post("/v1/completions", {"prompt": ""}), 400, "prompt")
    assert_error(post("/v1/completions", {"max_tokens": 3}), 400, "prompt")
    assert_error(post("/v1/completions", {"prompt": "a", "n": 2}), 400, "n")
    assert_error(post("/v1/chat/completions", {"messages": "hi"}), 400, "messages")
    assert_error(post("/v1/chat/completions", {"messages": [{"content": "hi"}]}), 400, "messages")
    err = assert_error(post("/v1/completions", {"model": "other", "prompt": "a"}), 404, "model")
    assert err["type"] == "NotFoundError"
    assert_error(post("/v1/completions", {"prompt": "a", "kv_transfer_params": [1]}), 400,
                 "kv_transfer_params")


def test_oversized_body_413(small_fleet: FleetThread) -> None:
    url = small_fleet.decode_urls[0]
    r = httpx.post(url + "/v1/completions", json={"prompt": "w " * 20_000, "max_tokens": 1})
    assert_error(r, 413)


def test_unknown_kv_handle(small_fleet: FleetThread) -> None:
    url = small_fleet.decode_urls[0]
    kv = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "nope",
          "remote_block_ids": [1], "remote_request_id": "x", "remote_host": "127.0.0.1", "remote_port": 1,
          "tp_size": 1}
    r = httpx.post(url + "/v1/completions", json={"prompt": "a", "stream": True, "kv_transfer_params": kv})
    assert_error(r, 400, "kv_transfer_params")
    kv["remote_engine_id"] = httpx.get(small_fleet.prefill_urls[0] + "/fleet/state").json()["kv_engine_id"]
    r = httpx.post(url + "/v1/completions", json={"prompt": "a", "kv_transfer_params": kv})
    assert "unknown or expired" in assert_error(r, 400, "kv_transfer_params")["message"]


def test_routes_and_methods(small_fleet: FleetThread) -> None:
    url = small_fleet.decode_urls[0]
    r = httpx.get(url + "/nope")
    assert r.status_code == 404 and r.json() == {"detail": "Not Found"}
    r = httpx.get(url + "/v1/completions")
    assert r.status_code == 405 and r.json() == {"detail": "Method Not Allowed"}
    r = httpx.post(url + "/fleet/faults", json={"bogus": 1})
    assert_error(r, 400)
    r = httpx.post(url + "/fleet/faults", json={"target": "decode/9", "slow": 2})
    assert_error(r, 404)


def test_server_still_serves_after_errors(small_fleet: FleetThread) -> None:
    url = small_fleet.decode_urls[0]
    assert httpx.get(url + "/health").status_code == 200
    r = httpx.post(url + "/v1/completions", json={"prompt": "a b", "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3

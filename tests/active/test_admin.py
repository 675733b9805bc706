"""Admin API security over real HTTP (`shadow serve` in process and as a real process): no token
→ PUT disabled; wrong or missing token → 401; malformed or oversized body → 4xx; nothing changes
without a valid token and a valid body; GET /v1/mode and /v1/report's "mode" stay open."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from shadow.active.modes import ModeConfig
from shadow.app.serve import ActiveSettings, ServeConfig
from shadow.mirror.config import MirrorConfig
from tests.active.procs import shadow_process
from tests.harness import ServeThread

TOKEN = "s3cret-admin-token-0123456789"


def _config(token: str | None) -> ServeConfig:
    workers = {"d0": "http://127.0.0.1:9", "d1": "http://127.0.0.1:9"}  # event-fed: nothing tapped
    tap = MirrorConfig(upstreams={}, workers=workers, slots=8, scrape_interval_s=0)
    return ServeConfig(tap=tap, mode_config=ModeConfig(mode="shadow", admin_token=token),
                       active=ActiveSettings())


@pytest.fixture
def api() -> Iterator[str]:
    with ServeThread(_config(TOKEN)) as s:
        yield s.ready["api"]


def _state(api: str) -> dict:  # type: ignore[type-arg]
    body = httpx.get(api + "/v1/mode", timeout=5).json()
    return {k: body[k] for k in ("current", "configured", "configured_policy", "pinned", "canary_fraction",
                                 "transitions_total")}


def test_without_a_token_put_is_disabled_and_get_stays_open() -> None:
    with ServeThread(_config(None)) as s:
        api = s.ready["api"]
        before = _state(api)
        for auth in (None, f"Bearer {TOKEN}", "Bearer"):
            headers = {"authorization": auth} if auth else {}
            r = httpx.put(api + "/v1/mode", json={"mode": "active"}, headers=headers, timeout=5)
            assert r.status_code == 403
            assert "disabled" in r.json()["error"] and "--admin-token" in r.json()["error"]
        assert _state(api) == before
        body = httpx.get(api + "/v1/mode", timeout=5).json()
        assert body["admin"] == {"put_enabled": False, "rejected": {"disabled": 3}}
        report = httpx.get(api + "/v1/report", timeout=5).json()
        assert report["mode"]["current"] == "shadow" and "lanes" in report


@pytest.mark.parametrize(
    "auth",
    [None, "", "Bearer", "Bearer  x", "Bearer wrong-token", f"Basic {TOKEN}", f"Bearer {TOKEN}x",
     f"Bearer {TOKEN[:-1]}", f"{TOKEN}", f"Token {TOKEN}"],
)
def test_a_wrong_or_missing_token_is_401_and_changes_nothing(api: str, auth: str | None) -> None:
    before = _state(api)
    headers = {"authorization": auth} if auth is not None else {}
    r = httpx.put(api + "/v1/mode", json={"mode": "active", "policy": "brh", "pin": True}, headers=headers,
                  timeout=5)
    assert r.status_code == 401, r.text
    assert r.headers["www-authenticate"].lower().startswith("bearer")
    assert _state(api) == before


def test_bad_bodies_are_4xx_and_change_nothing(api: str) -> None:
    ok = {"authorization": f"Bearer {TOKEN}"}
    before = _state(api)
    cases: list[tuple[dict[str, object], int]] = [
        ({"content": b'{"mode": "active"'}, 400),  # truncated JSON
        ({"content": b"\xff\xfe\x00"}, 400),  # not UTF-8
        ({"content": b""}, 400),
        ({"content": b'{"mode": "active", "pad": "' + b"x" * 5000 + b'"}'}, 413),  # over 4 KiB
        # chunked (no content-length), over 4 KiB
        ({"content": iter([b'{"mode": "active", "pad": "', b"x" * 3000, b"y" * 3000, b'"}'])}, 413),
        ({"json": ["active"]}, 422),
        ({"json": {"policy": "br0"}}, 422),  # mode missing
        ({"json": {"mode": "turbo"}}, 422),
        ({"json": {"mode": "active", "policy": "magic"}}, 422),
        ({"json": {"mode": "active", "pin": "yes"}}, 422),
        ({"json": {"mode": "canary", "canary_fraction": 1.5}}, 422),
        ({"content": b'{"mode": "canary", "canary_fraction": NaN}'}, 400),  # NaN is not JSON
        ({"json": {"mode": "active", "extra": 1}}, 422),
    ]
    for kwargs, status in cases:
        r = httpx.put(api + "/v1/mode", headers=ok, timeout=5, **kwargs)  # type: ignore[arg-type]
        assert r.status_code == status, (kwargs, r.status_code, r.text)
        assert "error" in r.json()
        assert _state(api) == before, kwargs
    rejected = httpx.get(api + "/v1/mode", timeout=5).json()["admin"]["rejected"]
    assert rejected == {"malformed": 4, "too_large": 2, "invalid": 7}


def test_a_valid_token_changes_the_mode_any_scheme_case(api: str) -> None:
    for scheme, body, want in [
        ("Bearer", {"mode": "canary", "policy": "brh", "canary_fraction": 0.3}, ("canary", "brh", False)),
        ("bearer", {"mode": "active", "pin": True}, ("active", "brh", True)),
        ("BEARER", {"mode": "fallback", "policy": "br0", "pin": False}, ("fallback", "br0", False)),
    ]:
        r = httpx.put(api + "/v1/mode", json=body, headers={"authorization": f"{scheme}  {TOKEN}"}, timeout=5)
        assert r.status_code == 200, r.text
        got = r.json()
        assert (got["configured"], got["configured_policy"], got["pinned"]) == want
        assert got["transitions"][-1]["reason"] == "operator"
    report = httpx.get(api + "/v1/report", timeout=5).json()["mode"]
    assert report["current"] == "fallback" and report["canary_fraction"] == 0.3
    assert {"current", "policy", "since", "fallback_reason", "transitions"} <= set(report)
    metrics = httpx.get(api + "/metrics", timeout=5).text
    assert 'shadow_mode{mode="fallback"} 1.0' in metrics
    assert 'shadow_mode_transitions_total{mode="canary",reason="operator"} 1.0' in metrics


def test_the_real_process_reads_the_token_from_the_environment_and_a_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = ["serve", "--worker", "d0=http://127.0.0.1:9", "--slots", "4", "--scrape-interval", "0",
            "--mode", "shadow"]
    token_file = tmp_path / "admin.token"
    token_file.write_text(TOKEN + "\n")
    for extra, env in ((["--admin-token-file", str(token_file)], {}),
                       ([], {"SHADOW_SERVE_ADMIN_TOKEN": TOKEN})):
        monkeypatch.delenv("SHADOW_SERVE_ADMIN_TOKEN", raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        with shadow_process([*base, *extra]) as (_, ready):
            api = ready["api"]
            assert httpx.put(api + "/v1/mode", json={"mode": "shadow"}, timeout=5).status_code == 401
            r = httpx.put(api + "/v1/mode", json={"mode": "shadow", "pin": True},
                          headers={"authorization": f"Bearer {TOKEN}"}, timeout=5)
            assert r.status_code == 200 and r.json()["pinned"] is True
    monkeypatch.delenv("SHADOW_SERVE_ADMIN_TOKEN")
    with shadow_process([*base, "--pin-mode"]) as (_, ready):  # no token anywhere: off
        r = httpx.put(ready["api"] + "/v1/mode", json={"mode": "shadow"},
                      headers={"authorization": f"Bearer {TOKEN}"}, timeout=5)
        assert r.status_code == 403 and "disabled" in r.json()["error"]
        assert httpx.get(ready["api"] + "/v1/mode", timeout=5).json()["pinned"] is True

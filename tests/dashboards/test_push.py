"""`shadow dashboards push` against an HTTP double of the Grafana API calls it uses (real HTTP on
loopback): exact requests, idempotent by uid, one-line errors on 401 / 404 / connection refused."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from shadow.cli import main
from shadow.telemetry.publish import PushError, push

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "glsa_test_token"


class GrafanaDouble:
    """The four endpoints push uses; records (method, path, body) of every request."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, Any]] = []
        self.folders: dict[str, dict[str, Any]] = {}
        self.dashboards: dict[str, dict[str, Any]] = {}
        self.provisioned: set[str] = set()
        double = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _reply(self, code: int, obj: Any) -> None:
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _handle(self, method: str) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n)) if n else None
                double.calls.append((method, self.path, body))
                if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                    return self._reply(401, {"message": "Unauthorized"})
                p = self.path
                if method == "GET" and p.startswith("/api/folders/"):
                    f = double.folders.get(p.rsplit("/", 1)[1])
                    return self._reply(200, f) if f else self._reply(404, {"message": "folder not found"})
                if method == "POST" and p == "/api/folders":
                    double.folders[body["uid"]] = {"uid": body["uid"], "title": body["title"]}
                    return self._reply(200, double.folders[body["uid"]])
                if method == "GET" and p.startswith("/api/dashboards/uid/"):
                    uid = p.rsplit("/", 1)[1]
                    if uid not in double.dashboards:
                        return self._reply(404, {"message": "Dashboard not found"})
                    entry = double.dashboards[uid]
                    meta = {"folderUid": entry.get("folderUid", ""), "provisioned": uid in double.provisioned}
                    return self._reply(200, {"dashboard": {**entry["dashboard"], "id": 7, "version": 3},
                                             "meta": meta})
                if method == "POST" and p == "/api/dashboards/db":
                    uid = body["dashboard"]["uid"]
                    double.dashboards[uid] = body
                    return self._reply(200, {"id": 7, "uid": uid, "status": "success", "version": 4})
                return self._reply(404, {"message": "Not found"})

            def do_GET(self) -> None:
                self._handle("GET")

            def do_POST(self) -> None:
                self._handle("POST")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> GrafanaDouble:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def grafana() -> Iterator[GrafanaDouble]:
    with GrafanaDouble() as g:
        yield g


def _dashboards() -> dict[str, dict[str, Any]]:
    return {p.name: json.loads(p.read_text()) for p in sorted((ROOT / "dashboards").glob("*.json"))}


def test_first_push_makes_exactly_the_expected_calls(grafana: GrafanaDouble) -> None:
    dash = _dashboards()
    out = push(dash, url=grafana.url, token=TOKEN, folder="Shadow routing")
    assert [(o.uid, o.action) for o in out] == [(d["uid"], "created") for _, d in sorted(dash.items())]
    expected: list[tuple[str, str, Any]] = [
        ("GET", "/api/folders/shadow-routing", None),
        ("POST", "/api/folders", {"title": "Shadow routing", "uid": "shadow-routing"}),
    ]
    for _, d in sorted(dash.items()):
        expected.append(("GET", f"/api/dashboards/uid/{d['uid']}", None))
        expected.append(("POST", "/api/dashboards/db", {
            "dashboard": {**d, "id": None}, "overwrite": True, "message": "shadow dashboards push",
            "folderUid": "shadow-routing"}))
    assert grafana.calls == expected


def test_second_push_is_a_no_op_and_a_change_updates_only_that_uid(grafana: GrafanaDouble) -> None:
    dash = _dashboards()
    push(dash, url=grafana.url, token=TOKEN, folder="Shadow routing")
    grafana.calls.clear()
    out = push(dash, url=grafana.url, token=TOKEN, folder="Shadow routing")
    assert {o.action for o in out} == {"unchanged"}
    assert [c[0] for c in grafana.calls] == ["GET"] * (1 + len(dash))
    grafana.calls.clear()
    changed = dict(dash)
    first = sorted(changed)[0]
    changed[first] = {**changed[first], "title": "renamed"}
    out = push(changed, url=grafana.url, token=TOKEN, folder="Shadow routing")
    assert [o.action for o in out].count("updated") == 1
    posts = [c for c in grafana.calls if c[0] == "POST"]
    assert len(posts) == 1 and posts[0][2]["dashboard"]["title"] == "renamed"


def test_provisioned_dashboards_are_never_overwritten(grafana: GrafanaDouble) -> None:
    dash = _dashboards()
    push(dash, url=grafana.url, token=TOKEN)
    uid = sorted(d["uid"] for d in dash.values())[0]
    grafana.provisioned.add(uid)
    changed = {k: {**v, "title": "x"} for k, v in dash.items()}
    out = {o.uid: o.action for o in push(changed, url=grafana.url, token=TOKEN)}
    assert out[uid] == "skipped-provisioned"
    assert grafana.dashboards[uid]["dashboard"]["title"] != "x"


def test_wrong_token_is_a_one_line_401(grafana: GrafanaDouble, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(PushError, match=r"401 unauthorized.*--token"):
        push(_dashboards(), url=grafana.url, token="wrong", folder="Shadow routing")
    rc = main(["dashboards", "push", "--url", grafana.url, "--token", "wrong",
               "--dir", str(ROOT / "dashboards")])
    err = capsys.readouterr().err
    assert rc == 1 and err.count("\n") == 1 and "401" in err
    assert not grafana.dashboards


def test_wrong_url_path_is_a_one_line_404(grafana: GrafanaDouble, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["dashboards", "push", "--url", grafana.url + "/grafana", "--token", TOKEN, "--folder", "x",
               "--dir", str(ROOT / "dashboards")])
    err = capsys.readouterr().err
    assert rc == 1 and err.count("\n") == 1 and "404" in err and "Grafana root URL" in err


def test_connection_refused_is_a_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound but not listening: connections are refused
        rc = main(["dashboards", "push", "--url", f"http://127.0.0.1:{port}", "--token", TOKEN,
                   "--dir", str(ROOT / "dashboards"), "--timeout", "2"])
    err = capsys.readouterr().err
    assert rc == 1 and err.count("\n") == 1 and "connection refused" in err, err


def test_cli_push_prints_one_line_per_dashboard(
    grafana: GrafanaDouble, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = main(["dashboards", "push", "--url", grafana.url, "--token", TOKEN,
               "--dir", str(ROOT / "dashboards")])
    out = capsys.readouterr().out.splitlines()
    assert rc == 0 and len(out) == len(_dashboards()) and all("created" in line for line in out)

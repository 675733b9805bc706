"""A stand-in for shadow's event API that keeps every NDJSON line posted to it: where a bench or a
test points an engine probe (SHADOW_PROBE_URL) to read its steps without a `shadow serve`."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class EventSink:
    """Listens on a free loopback port (`url`); `events` holds every line posted, in order;
    `close()` stops it."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        lock = threading.Lock()
        events = self.events

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with lock:
                    events.extend(json.loads(line) for line in body.splitlines() if line.strip())
                out = b'{"rejected": {}}'
                self.send_response(200)
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def steps(self) -> list[dict[str, Any]]:
        """The step events posted so far."""
        return [e for e in list(self.events) if e.get("type") == "step"]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

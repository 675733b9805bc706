"""The mode admin API on `shadow serve`'s API listener.

- `GET /v1/mode`: the controller's state (open, like /v1/report).
- `PUT /v1/mode` with `{"mode": ..., "policy": ..., "canary_fraction": ..., "pin": bool}` and
  `Authorization: Bearer <token>`. No token configured: 403, the API is off. Wrong or missing
  token: 401. Body over `max_body` (default 4 KiB): 413. Not JSON, or JSON no reader should take
  (nested over 1024 deep, a number beyond a double or a 64-bit integer): 400. Unknown key or
  invalid value: 422. A valid mode this process cannot carry out (no active proxy: only `shadow`):
  409 with the reason. Nothing changes unless the token is valid and the whole body is. Refusals are
  counted by reason (`rejected`, shown in GET /v1/mode).
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from orjson import JSONDecodeError
from orjson import loads as json_loads

from shadow.active.flagfile import setting_from
from shadow.active.modes import ModeController, ModeUnavailable
from shadow.base.listener import capped_body
from shadow.base.security import bearer_ok

DEFAULT_MAX_BODY = 4096
DISABLED = ("PUT /v1/mode is disabled: no admin token configured (start shadow serve with "
            "--admin-token-file FILE, --admin-token or SHADOW_SERVE_ADMIN_TOKEN)")


def mode_router(
    controller: ModeController,
    token: str | None,
    view: Callable[[], dict[str, Any]],
    rejected: MutableMapping[str, int],
    *,
    max_body: int = DEFAULT_MAX_BODY,
) -> APIRouter:
    """GET/PUT /v1/mode over `controller`: GET serves `view()`, refusals are counted in `rejected`
    by reason."""
    router = APIRouter()

    def refuse(status: int, reason: str, message: str, headers: dict[str, str] | None = None) -> Response:
        rejected[reason] = rejected.get(reason, 0) + 1
        return JSONResponse({"error": message}, status_code=status, headers=headers)

    @router.get("/v1/mode")
    async def get_mode() -> Response:
        return JSONResponse(view())

    @router.put("/v1/mode")
    async def put_mode(request: Request) -> Response:
        if token is None:
            return refuse(403, "disabled", DISABLED)
        if not bearer_ok(request.headers.get("authorization"), token):
            return refuse(401, "unauthorized", "PUT /v1/mode needs 'Authorization: Bearer <admin token>'",
                          {"www-authenticate": 'Bearer realm="shadow"'})
        raw = await capped_body(request, max_body)
        if raw is None:
            return refuse(413, "too_large", f"body over {max_body} bytes")
        try:
            data = json_loads(raw)  # bounded: depth 1024, numbers within a double / 64-bit integer
        except (JSONDecodeError, RecursionError):
            return refuse(400, "malformed", 'body must be JSON: {"mode": ..., "policy": ..., "pin": ...}')
        try:
            setting = setting_from(data, "body")
        except ValueError as exc:
            return refuse(422, "invalid", str(exc))
        try:
            return JSONResponse(controller.apply(setting, "operator"))
        except ModeUnavailable as exc:
            return refuse(409, "unavailable", str(exc))

    return router

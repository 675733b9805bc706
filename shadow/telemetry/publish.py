"""Publish dashboards to Grafana's HTTP API with grafana-client, idempotently by uid.

`push(dashboards, url=..., token=...)`: ensure the folder (by uid) when one is named, then for each
dashboard GET it by uid, compare with ours (ignoring `id`, `version`, `iteration`) and POST it only
when it differs or is missing; never overwrite a provisioned dashboard. Any failure raises
`PushError` with a one-line message (401, 403, 404, connection refused, timeouts, other statuses).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from grafana_client.api import GrafanaApi
from grafana_client.client import (
    GrafanaClientError,
    GrafanaException,
    GrafanaServerError,
    GrafanaTimeoutError,
    GrafanaUnauthorizedError,
)

_VOLATILE = ("id", "version", "iteration")


class PushError(Exception):
    """A one-line reason the push failed."""


@dataclass(frozen=True)
class Outcome:
    uid: str
    action: str  # created | updated | unchanged | skipped-provisioned


def folder_uid(title: str) -> str:
    """A stable folder uid from its title (Grafana: at most 40 of [a-zA-Z0-9_-])."""
    slug = re.sub(r"[^a-zA-Z0-9_-]+", "-", title.strip().lower()).strip("-")
    return (slug or "shadow")[:40]


def _normal(d: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if k not in _VOLATILE}


def _explain(exc: Exception, url: str, what: str) -> PushError:
    if isinstance(exc, GrafanaUnauthorizedError):
        return PushError(f"grafana {url}: 401 unauthorized while {what} (check --token)")
    if isinstance(exc, GrafanaClientError):
        code = exc.status_code
        hints = {403: "the token lacks permission", 404: "is --url the Grafana root URL?"}
        hint = hints.get(code, exc.message)
        return PushError(f"grafana {url}: {code} while {what} ({hint})")
    if isinstance(exc, GrafanaServerError):
        return PushError(f"grafana {url}: server error {exc.status_code} while {what}")
    if isinstance(exc, GrafanaTimeoutError):
        return PushError(f"grafana {url}: timed out while {what}")
    text = str(exc).lower()
    if "refused" in text:
        return PushError(f"grafana {url}: connection refused while {what}")
    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return PushError(f"grafana {url}: {type(exc).__name__} while {what}: {first[:200]}")


def _get_or_none(call: Any, *args: Any) -> Any:
    try:
        return call(*args)
    except GrafanaClientError as exc:
        if exc.status_code == 404 and not isinstance(exc, GrafanaUnauthorizedError):
            return None
        raise


def push(
    dashboards: Mapping[str, Mapping[str, Any]],
    *,
    url: str,
    token: str,
    folder: str | None = None,
    timeout_s: float = 10.0,
    message: str = "shadow dashboards push",
) -> list[Outcome]:
    """Publish `dashboards` ({name: dashboard JSON}); returns what happened to each uid."""
    api = GrafanaApi.from_url(url.rstrip("/"), credential=token, timeout=timeout_s)
    fuid = folder_uid(folder) if folder else None
    out: list[Outcome] = []
    what = "checking the folder"
    try:
        if folder and fuid and _get_or_none(api.folder.get_folder, fuid) is None:
            what = "creating the folder"
            api.folder.create_folder(folder, uid=fuid)
        for name in sorted(dashboards):
            dash = dict(dashboards[name])
            uid = str(dash.get("uid") or "")
            if not uid:
                raise PushError(f"{name}: dashboard has no uid")
            what = f"reading dashboard {uid}"
            current = _get_or_none(api.dashboard.get_dashboard, uid)
            if current is not None:
                meta = current.get("meta", {})
                if meta.get("provisioned"):
                    out.append(Outcome(uid, "skipped-provisioned"))
                    continue
                same_folder = (meta.get("folderUid") or None) == fuid
                if same_folder and _normal(current.get("dashboard", {})) == _normal(dash):
                    out.append(Outcome(uid, "unchanged"))
                    continue
            what = f"saving dashboard {uid}"
            body: dict[str, Any] = {"dashboard": {**dash, "id": None}, "overwrite": True, "message": message}
            if fuid:
                body["folderUid"] = fuid
            api.dashboard.update_dashboard(body)
            out.append(Outcome(uid, "created" if current is None else "updated"))
    except PushError:
        raise
    except (GrafanaException, OSError, Exception) as exc:  # niquests' connection errors are OSErrors
        raise _explain(exc, url, what) from None
    return out

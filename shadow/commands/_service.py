"""How the commands that run a server start and fail: logging from --log-level/--log-format, one
start-up line with the configuration, and on failure one line on stderr, exit 2 or 1."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from shadow.app import logs
from shadow.commands._flags import add_flags, flag

#: Every server command's logging flags (`shadow serve` also reads SHADOW_SERVE_LOG_LEVEL, ...).
LOG_FLAGS = (
    flag("--log-level", None, f"least severe level logged: {', '.join(logs.LEVELS)} (default "
         f"{logs.DEFAULT_LEVEL})", choices=logs.LEVELS, default=logs.DEFAULT_LEVEL, type=str.lower),
    flag("--log-format", None, "log lines on stderr as text, or json (one object per line: ts, level, "
         f"logger, message, trace_id, span_id) (default {logs.DEFAULT_FORMAT})",
         choices=logs.FORMATS, default=logs.DEFAULT_FORMAT),
)
# Options whose values are never logged (their names say they hold a credential: a token or its file,
# not a setting that merely mentions tokens, such as --token-interval).
_SECRET = re.compile(r"(^|_)token(_file)?$|secret|password|api_key|credential", re.IGNORECASE)


def add_log_arguments(p: argparse.ArgumentParser) -> None:
    add_flags(p.add_argument_group("logging"), LOG_FLAGS)


def _safe(value: Any) -> Any:
    """`value` with the user and password of any URL in it left out."""
    if isinstance(value, str) and "@" in value and "://" in value:
        name, sep, url = value.rpartition("=") if "=" in value.split("://")[0] else ("", "", value)
        parts = urlsplit(url)
        if parts.username is not None or parts.password is not None:
            host = parts.hostname or ""
            netloc = f"{host}:{parts.port}" if parts.port else host
            url = urlunsplit(parts._replace(netloc=netloc))
        return f"{name}{sep}{url}"
    if isinstance(value, list | tuple):
        return [_safe(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _safe(v) for k, v in value.items()}
    return value


def summary(args: argparse.Namespace) -> dict[str, Any]:
    """The options as logged at start-up: credentials redacted, URLs without user and password."""
    out: dict[str, Any] = {}
    for k, v in sorted(vars(args).items()):
        if callable(v) or k in ("func", "command"):
            continue
        out[k] = "<redacted>" if _SECRET.search(k) and v is not None else _safe(v)
    return out


def start_logging(prog: str, args: argparse.Namespace) -> None:
    """Configure this process's logging from `args` and log the start-up line."""
    logs.configure(args.log_level, args.log_format)
    logs.started(prog, summary(args))


def _fail(prog: str, exc: Exception) -> None:
    if logs.configured():
        logs.failed(prog, exc)
    else:
        print(f"{prog}: {exc}", file=sys.stderr)


def run_reporting(prog: str, body: Callable[[], None]) -> int:
    """Run a service's `body`; bad configuration exits 2, OS errors (ports, files) 1, one line each
    (a log line once logging is configured)."""
    try:
        body()
    except ValueError as exc:
        _fail(prog, exc)
        return 2
    except OSError as exc:
        _fail(prog, exc)
        return 1
    return 0

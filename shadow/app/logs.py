"""A process's logging, configured once: level, text or JSON lines on stderr, trace ids.

`configure(level, fmt)` replaces the root logger's handlers with one stderr handler (uvicorn's and
every library's loggers propagate to it); `fmt` "json" writes one object per line: `ts` (UTC,
RFC 3339, ms), `level`, `logger`, `message`, `trace_id`/`span_id` (hex, when the record was made in
a valid span context), `exc` (the traceback, when there is one) and the record's `extra` fields.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections.abc import Mapping
from types import TracebackType
from typing import IO, Any

from opentelemetry import trace

LEVELS = ("debug", "info", "warning", "error", "critical")
FORMATS = ("text", "json")
DEFAULT_LEVEL = "info"
DEFAULT_FORMAT = "text"
#: Loggers of libraries that are chatty at INFO about things an operator of shadow does not act on.
QUIET = {"httpx": logging.WARNING, "httpcore": logging.WARNING, "uvicorn.access": logging.WARNING}
# The attributes every LogRecord has: anything else on a record came in `extra=` and is logged.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


def _ts(created: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created)) + f".{int(created % 1 * 1000):03d}Z"


def _trace_ids() -> dict[str, str]:
    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return {}
    return {"trace_id": format(ctx.trace_id, "032x"), "span_id": format(ctx.span_id, "016x")}


class _TraceIds(logging.Filter):
    """Puts the current span's ids on the record (when it is made, in the logging thread's context)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "trace_id"):
            for k, v in _trace_ids().items():
                setattr(record, k, v)
        return True


def _extra(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_")}


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (see the module docstring)."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": _ts(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        doc.update(_extra(record))
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            doc["exc"] = record.exc_text
        return json.dumps(doc, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """`TS LEVEL logger: message key=value ...` (extra fields and trace ids as key=value)."""

    def format(self, record: logging.LogRecord) -> str:
        extra = " ".join(f"{k}={v}" for k, v in _extra(record).items())
        line = f"{_ts(record.created)} {record.levelname:<7} {record.name}: {record.getMessage()}"
        if extra:
            line += f" [{extra}]"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def configured() -> bool:
    """Whether `configure` set up this process's logging."""
    return any(isinstance(f, _TraceIds) for h in logging.getLogger().handlers for f in h.filters)


def configure(level: str = DEFAULT_LEVEL, fmt: str = DEFAULT_FORMAT, stream: IO[str] | None = None) -> None:
    """Configure this process's logging (again: the previous handlers go). ValueError names a bad
    level or format."""
    name = str(level).strip().lower()
    if name not in LEVELS:
        raise ValueError(f"--log-level must be one of {', '.join(LEVELS)}, got {level!r}")
    if fmt not in FORMATS:
        raise ValueError(f"--log-format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(_TraceIds())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(name.upper())
    for logger, at_least in QUIET.items():
        logging.getLogger(logger).setLevel(max(at_least, root.level))
    for lib in ("uvicorn", "uvicorn.error"):  # uvicorn may have set up handlers of its own
        logging.getLogger(lib).handlers.clear()
        logging.getLogger(lib).propagate = True
    logging.captureWarnings(True)
    sys.excepthook = _log_uncaught
    threading.excepthook = _log_thread_exception


def _log_uncaught(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    if issubclass(kind, KeyboardInterrupt):
        sys.__excepthook__(kind, exc, tb)
        return
    logging.getLogger("shadow").critical("uncaught exception", exc_info=(kind, exc, tb))


def _log_thread_exception(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit:
        return
    exc = args.exc_value if args.exc_value is not None else args.exc_type()
    name = args.thread.name if args.thread is not None else "?"
    info = (args.exc_type, exc, args.exc_traceback)
    logging.getLogger("shadow").error("thread %s died", name, exc_info=info)


def failed(prog: str, exc: BaseException) -> None:
    """The line of a process that stops on an error (`prog: message`, at error level)."""
    logging.getLogger("shadow").error("%s: %s", prog, exc)


def started(prog: str, summary: Mapping[str, Any]) -> None:
    """The one start-up line: `prog` and its configuration summary (the caller leaves secrets and
    prompt text out of `summary`)."""
    logging.getLogger("shadow").info("%s started", prog, extra={"config": dict(summary)})

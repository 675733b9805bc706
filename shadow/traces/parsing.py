"""Shared loader plumbing: field parsers that raise one-line `TraceError`s naming file and line,
and `collect_requests`, which checks time order, applies the limit and normalises arrivals so that
the first request is at 0.0. Files are opened by `shadow.traces.lines.open_lines`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from shadow.contracts.events import MAX_REQUEST_TOKENS
from shadow.traces.model import TraceError, TraceRequest

# One parsed row: (line number, arrival in seconds on the file's own clock, prompt tokens,
# output tokens, prompt key, the arrival as written in the file, for messages).
Row = tuple[int, float, int, int, str | None, str]


def show(value: object, width: int = 40) -> str:
    """A short one-line repr of a bad value, for error messages."""
    try:
        text = repr(value)
    except ValueError:  # an int too long to print
        text = "<a number too long to show>"
    return text if len(text) <= width else text[: width - 3] + "..."


def checked_count(value: int, field: str, path: str, line: int) -> int:
    """`value` if it is a plausible token count (1 <= value <= MAX_REQUEST_TOKENS), else a TraceError."""
    if value < 1:
        raise TraceError.at(path, line, f"{field} must be >= 1, got {value}")
    if value > MAX_REQUEST_TOKENS:
        raise TraceError.at(path, line, too_many_tokens(value, field))
    return value


def too_many_tokens(value: int, field: str) -> str:
    """What is wrong with a token count beyond MAX_REQUEST_TOKENS, the live mirror's bound."""
    return f"{field} {show(value)} is more than {MAX_REQUEST_TOKENS} tokens (the limit for one request)"


def count_from_text(text: str, field: str, path: str, line: int) -> int:
    """A token count (whole number >= 1) from a CSV cell."""
    try:
        value = int(text)
    except ValueError:
        try:
            number = float(text)
        except ValueError:
            raise TraceError.at(path, line, f"{field} is not a number: {show(text)}") from None
        if not math.isfinite(number):
            raise TraceError.at(path, line, f"{field} must be a finite number, got {show(text)}") from None
        if not number.is_integer():
            raise TraceError.at(path, line, f"{field} must be a whole number, got {show(text)}") from None
        value = int(number)
    return checked_count(value, field, path, line)


def count_from_json(value: object, field: str, path: str, line: int) -> int:
    """A token count (whole number >= 1) from a JSON value (numbers only, no strings or booleans)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TraceError.at(path, line, f"{field} is not a number: {show(value)}")
    if isinstance(value, float):
        if not value.is_integer():
            raise TraceError.at(path, line, f"{field} must be a whole number, got {show(value)}")
        value = int(value)
    return checked_count(value, field, path, line)


def seconds_from_text(text: str, field: str, path: str, line: int) -> float:
    """A finite time in seconds from a CSV cell."""
    try:
        value = float(text)
    except ValueError:
        raise TraceError.at(path, line, f"{field} is not a number: {show(text)}") from None
    if not math.isfinite(value):
        raise TraceError.at(path, line, f"{field} must be finite, got {show(text)}")
    return value


def seconds_from_json(value: object, field: str, path: str, line: int) -> float:
    """A finite time from a JSON number."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TraceError.at(path, line, f"{field} is not a number: {show(value)}")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise TraceError.at(path, line, f"{field} must be finite, got {show(value)}")
    return number


def parse_json_line(text: str, path: str, line: int) -> object:
    """The JSON value on one line, or a one-line TraceError."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise TraceError.at(path, line, f"invalid JSON: {err.msg} at column {err.colno}") from None
    except ValueError as err:  # e.g. an integer literal with too many digits
        raise TraceError.at(path, line, f"invalid JSON: {err}") from None
    except RecursionError:
        raise TraceError.at(path, line, "invalid JSON: nested too deeply") from None


def json_objects(lines: Iterator[str], path: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for every non-blank line of a JSON Lines stream; bad lines raise TraceError."""
    for line, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        value = parse_json_line(text.rstrip(), path, line)
        if not isinstance(value, dict):
            raise TraceError.at(path, line, f"expected a JSON object, got {show(value)}")
        yield line, value


def json_rows(
    lines: Iterator[str],
    path: str,
    fields: tuple[str, str, str],
    key: Callable[[dict[str, Any], int], str | None],
    unit: tuple[float, str] = (1.0, "s"),
) -> Iterator[Row]:
    """Rows of a JSON Lines trace: `fields` name its arrival time, prompt and output tokens; `key`
    reads a row's prompt key (object, line); `unit` is (time units per second, their suffix)."""
    time_field, prompt_field, output_field = fields
    per_second, suffix = unit
    for line, obj in json_objects(lines, path):
        stamp = require(obj, time_field, path, line)
        arrival = seconds_from_json(stamp, time_field, path, line)
        if per_second != 1.0:
            arrival /= per_second
        prompt = count_from_json(require(obj, prompt_field, path, line), prompt_field, path, line)
        output = count_from_json(require(obj, output_field, path, line), output_field, path, line)
        yield line, arrival, prompt, output, key(obj, line), f"{stamp} {suffix}"


def require(obj: dict[str, Any], field: str, path: str, line: int) -> object:
    """obj[field], or a TraceError naming the missing field."""
    try:
        return obj[field]
    except KeyError:
        raise TraceError.at(path, line, f"missing field {field!r}") from None


def csv_header(
    reader: Iterator[list[str]],
    line_num: Callable[[], int],
    path: str,
    required: Sequence[str],
    optional: Sequence[str] = (),
) -> tuple[list[int], int]:
    """Read the header (skipping blank lines); return (index of each required then optional column,
    number of header cells). An absent optional column has index -1.

    Column names match case-insensitively, ignoring surrounding spaces; other columns are ignored.
    """
    header = next(reader, None)
    while header is not None and not any(cell.strip() for cell in header):
        header = next(reader, None)
    if header is None:
        raise TraceError.at(path, None, "file is empty")
    names = [cell.strip().lower() for cell in header]
    missing = [col for col in required if col.lower() not in names]
    if missing:
        raise TraceError.at(
            path,
            line_num(),
            f"missing column(s) {', '.join(missing)} in header {show(','.join(header), 80)}",
        )
    index = {name: i for i, name in reversed(list(enumerate(names)))}
    return [index.get(col.lower(), -1) for col in (*required, *optional)], len(header)


def csv_rows(
    reader: Iterator[list[str]], line_num: Callable[[], int], path: str, need: int, width: int
) -> Iterator[tuple[int, list[str]]]:
    """(line number, cells) of each non-blank data row having at least `need` cells."""
    for cells in reader:
        if not cells or (len(cells) == 1 and not cells[0].strip()):
            continue
        line = line_num()
        if len(cells) < need:
            raise TraceError.at(
                path, line, f"expected {width} columns, got {len(cells)}: {show(','.join(cells))}"
            )
        yield line, cells


def collect_requests(
    rows: Iterable[Row], *, path: str, limit: int | None, time_field: str
) -> tuple[tuple[TraceRequest, ...], bool]:
    """Consume `rows` lazily into requests whose first arrival is 0.0; stop after `limit` requests.

    Returns (requests, whether the limit cut the file short). Raises TraceError when a row goes back
    in time or when there is no row at all.
    """
    requests: list[TraceRequest] = []
    first = 0.0
    previous = -math.inf
    previous_line = 0
    previous_shown = ""
    for line, arrival, prompt, output, key, shown in rows:
        if arrival < previous:
            raise TraceError.at(
                path,
                line,
                f"{time_field} goes back in time: {shown} is earlier than {previous_shown} "
                f"at line {previous_line} (rows must be sorted by arrival)",
            )
        if not requests:
            first = arrival
        previous, previous_line, previous_shown = arrival, line, shown
        requests.append(TraceRequest(arrival - first, prompt, output, key))
        if limit is not None and len(requests) >= limit:
            return tuple(requests), True
    if not requests:
        raise TraceError.at(path, None, "no requests in file")
    return tuple(requests), False


def limit_note(count: int, cut: bool) -> str:
    """The note a loader adds when `limit` cut the file short ("" otherwise)."""
    return f"; first {count} requests of the file (limit)" if cut else ""

"""`open_lines`: a trace file's lines, read within its `TraceLimits`.

The file is read as UTF-8 text (a BOM tolerated; gzip, of any number of members, decompressed as it
is read), each line with its terminator as written (`newline=""`, what `csv` expects). Every line is
read with a length limit, so memory stays bounded whatever the file holds. A one-line TraceError
naming the file, the line, the value and its limit ends the read when a line is longer than
`max_line_chars`, more than `max_blank_lines` lines in a row are blank, the file has more than
`max_lines` lines, or a gzip file expands more than `max_gzip_ratio` times; OS, gzip and decoding
errors are TraceErrors too.
"""

from __future__ import annotations

import gzip
import io
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import IO

from shadow.traces.limits import TraceLimits
from shadow.traces.model import TraceError

GZIP_MAGIC = b"\x1f\x8b"
RATIO_EVERY = 1 << 20  # characters between two looks at a gzip file's expansion


@contextmanager
def open_lines(path: str, limits: TraceLimits) -> Iterator[Iterator[str]]:
    """The lines of the file at `path` (see module docstring); a TraceError when it cannot be opened."""
    try:
        raw = open(path, "rb")  # noqa: SIM115 - closed below, after the text layer over it
    except OSError as err:
        raise TraceError.at(path, None, f"cannot open: {err.strerror or err}") from None
    with raw:
        try:
            gzipped = raw.read(2) == GZIP_MAGIC
            raw.seek(0)
        except OSError as err:
            raise TraceError.at(path, None, f"cannot read: {err.strerror or err}") from None
        binary: gzip.GzipFile | io.BufferedReader = gzip.GzipFile(fileobj=raw, mode="rb") if gzipped else raw
        with io.TextIOWrapper(binary, encoding="utf-8-sig", newline="") as handle:
            try:
                yield _lines(handle, path, limits, raw.tell if gzipped else None)
            except UnicodeDecodeError as err:
                what = f"not UTF-8 text ({err.reason} at byte {err.start})"
                raise TraceError.at(path, None, what) from None
            except (OSError, EOFError, zlib.error) as err:
                raise TraceError.at(path, None, f"cannot read: {err}") from None


def _lines(
    handle: IO[str], path: str, limits: TraceLimits, compressed: Callable[[], int] | None
) -> Iterator[str]:
    """Each line of `handle` within `limits`; `compressed` says how many bytes of a gzip file were
    consumed so far (None: not compressed)."""
    longest, most, blanks = limits.max_line_chars, limits.max_lines, limits.max_blank_lines
    readline = handle.readline
    line = blank = chars = 0
    look_at = limits.gzip_ratio_after
    while text := readline(longest + 1):
        line += 1
        if len(text) > longest:
            raise TraceError.at(path, line, f"line longer than {longest} characters (the limit)")
        if line > most:
            what = f"more than {most} lines (the limit; `shadow replay|sweep --max-trace-lines` raises it)"
            raise TraceError.at(path, line, what)
        if text.isspace():
            blank += 1
            if blank > blanks:
                raise TraceError.at(path, line, f"more than {blanks} blank lines in a row (the limit)")
        else:
            blank = 0
        if compressed is not None:
            chars += len(text)
            if chars >= look_at:
                look_at = chars + RATIO_EVERY
                ratio = chars / max(1, compressed())
                if ratio > limits.max_gzip_ratio:
                    raise TraceError.at(
                        path, line, f"gzip data expands {ratio:.0f} times, more than "
                        f"{limits.max_gzip_ratio:g} (the limit): not a trace"
                    )
        yield text

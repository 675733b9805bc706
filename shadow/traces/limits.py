"""What one trace or recording file may claim (`TraceLimits`), declared once and checked as it is
read, before anything is sized by it: a file names the value, the limit and its line in a one-line
TraceError instead of costing memory or time out of proportion to its size.

Token counts are bounded by `shadow.contracts.events.MAX_REQUEST_TOKENS`, the live mirror's bound
(a replay runs a request for as many steps as its tokens), not by a field here.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True, slots=True)
class TraceLimits:
    """The bounds a loader applies (`shadow replay|sweep --max-trace-lines` sets `max_lines`).

    - `max_lines`: lines in one file (blank ones included); memory grows with the requests read
      (0.3 GB per million requests of a trace, 0.5 GB of a recording).
    - `max_line_chars`: characters in one line, its terminator included; a longer line is never
      held whole (a recording's longest line is a rolling seed: about 80 characters per request
      in flight).
    - `max_blank_lines`: lines in a row holding nothing but white space.
    - `max_gzip_ratio`: decompressed characters per compressed byte of a gzip file, judged once
      `gzip_ratio_after` characters were read (traces and recordings compress 3 to 10 times; a
      run of one repeated byte about 1000 times).
    - `max_workers`: decode workers a recording names (its header, or its requests).
    - `max_fleet_slots`: workers × slots per worker a recording's lanes ran with, and `max_lanes`
      the lanes (policies) it names: each replayed lane holds every slot of the fleet.
    - `max_windows`: rolling windows a recording spans (its arrivals over the window length),
      and the highest window a seed may name.
    """

    max_lines: int = 4_000_000
    max_line_chars: int = 16 << 20
    max_blank_lines: int = 100_000
    max_gzip_ratio: float = 100.0
    gzip_ratio_after: int = 8 << 20
    max_workers: int = 4096
    max_fleet_slots: int = 1 << 18
    max_lanes: int = 64
    max_windows: int = 100_000

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not value >= 1:
                raise ValueError(f"trace limit {f.name} must be >= 1, got {value!r}")


DEFAULT_LIMITS = TraceLimits()  # frozen: shared by every loader called without limits of its own

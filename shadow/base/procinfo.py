"""The standard metrics of one server process: `shadow_build_info` and prometheus_client's
`process_*` (CPU, memory, file descriptors, start time; Linux /proc), declared like every family."""

from __future__ import annotations

import platform
from collections.abc import Iterable

from prometheus_client import ProcessCollector
from prometheus_client.core import Metric

from shadow.base.families import DeclaredCollector, Family

BUILD_INFO = Family("shadow_build_info", "gauge",
                    "Always 1: the version of shadow and of the Python running it.", "info",
                    ("version", "python"))
#: The families prometheus_client's ProcessCollector exports (its names and help texts).
PROCESS = (
    Family("process_virtual_memory_bytes", "gauge", "Virtual memory size in bytes.", "bytes"),
    Family("process_resident_memory_bytes", "gauge", "Resident memory size in bytes.", "bytes"),
    Family("process_start_time_seconds", "gauge",
           "Start time of the process since unix epoch in seconds.", "seconds"),
    Family("process_cpu_seconds_total", "counter", "Total user and system CPU time spent in seconds.",
           "seconds"),
    Family("process_open_fds", "gauge", "Number of open file descriptors.", "descriptors"),
    Family("process_max_fds", "gauge", "Maximum number of open file descriptors.", "descriptors"),
)
FAMILIES = (BUILD_INFO, *PROCESS)


class ProcessInfo(DeclaredCollector):
    """`shadow_build_info` and this process's `process_*` families, read at scrape time."""

    families = FAMILIES

    def __init__(self, version: str) -> None:
        """`version`: shadow's (`shadow.__version__`, which this floor does not import)."""
        self._process = ProcessCollector(registry=None)
        self._build = BUILD_INFO.sampled({(version, platform.python_version()): 1.0})

    def collect(self) -> Iterable[Metric]:
        yield self._build
        yield from self._process.collect()

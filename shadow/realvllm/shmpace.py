"""A vLLM general plugin (entry point group `vllm.general_plugins`) that paces the readers of vLLM's
shared-memory message queues. vLLM 0.32's `SpinCondition` keeps a reader busy-looping
(`sched_yield`) for 1 s after its last read, with no setting: under steady decode an engine core
spins while its worker computes and the worker spins between steps, so on the CPU build every
engine keeps two threads runnable all the time, and on a small host they take the cores from each
other's forward passes. With `SHADOW_SHM_SPIN_SLEEP_US=N` a reader inside that second sleeps N µs
between its checks instead of yielding (a step learns of its input at most ~N µs late); past it,
vLLM's own idle wait is unchanged. Inert when unset.

Not done instead: a shorter busy second (vLLM's idle wait on the queue's notify socket then runs
at every step; measured: both engines of a 2-server fleet stalled within seconds, 8 running
requests each, a notification lost).
`shadow fleet --engine vllm` sets 100 µs for the servers it starts unless their environment has
its own value (`shadow.realvllm.launcher.SHM_SPIN_SLEEP_US`; empty: off).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from shadow.realvllm.pluginenv import micros_from_env, patch_once, setting_or_warn

ENV = "SHADOW_SHM_SPIN_SLEEP_US"
LOG = logging.getLogger("vllm.plugins.shadow_shmpace")  # under vLLM's handler: in its log


def sleep_from_env(environ: dict[str, str] | os._Environ[str] = os.environ) -> int | None:
    """The sleep asked for (µs), None when unset; ValueError for a value that is not an int ≥ 1."""
    return micros_from_env(ENV, 1, environ)


def pace(spin_condition: Any, sleep_us: int) -> bool:
    """Make every reader of `spin_condition` (the class) sleep `sleep_us` between checks while
    vLLM would spin, instances made before included (False: already paced)."""
    pause = sleep_us / 1e6

    def wrap(wait: Any) -> Any:
        def paced(self: Any, timeout_ms: int | None = None) -> None:
            if time.monotonic() <= self.last_read + self.busy_loop_s:
                time.sleep(pause)
            else:
                wait(self, timeout_ms)
        return paced

    return patch_once(spin_condition, "wait", wrap)

def register() -> None:
    """The plugin's entry point (vLLM calls it in every process it starts; idempotent)."""
    sleep_us = setting_or_warn(sleep_from_env, LOG, "shadow shmpace",
                               "vLLM's message queues left as they are")
    if sleep_us is None:
        return
    try:
        from vllm.distributed.device_communicators import shm_broadcast
    except ImportError:
        return
    spin = getattr(shm_broadcast, "SpinCondition", None)
    if spin is None or not hasattr(spin, "wait"):
        LOG.warning("shadow shmpace: this vLLM has no SpinCondition; its message queues left as they are")
        return
    if pace(spin, sleep_us):
        LOG.info("shadow shmpace: message-queue readers sleep %d µs between checks instead of spinning",
                 sleep_us)

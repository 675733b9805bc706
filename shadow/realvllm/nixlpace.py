"""A vLLM general plugin (entry point group `vllm.general_plugins`) that paces NIXL's progress
thread. NIXL 1.5's Python agent hard-codes the thread's delay to 0 µs, so each NixlConnector
worker keeps a core busy polling UCX (`poll(…, 0)` in a loop) even when idle: a P/D pair on a
2-core machine takes both cores from everything else. With `SHADOW_NIXL_PROGRESS_DELAY_US=N` the
thread sleeps N µs between polls (1000: ~1 % of a core idle); inert when unset or where NIXL is
absent. `shadow fleet --engine vllm` sets it for the servers it starts.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from shadow.realvllm.pluginenv import micros_from_env, patch_once, setting_or_warn

ENV = "SHADOW_NIXL_PROGRESS_DELAY_US"
LOG = logging.getLogger("vllm.plugins.shadow_nixlpace")  # under vLLM's handler: in its log


def delay_from_env(environ: dict[str, str] | os._Environ[str] = os.environ) -> int | None:
    """The delay asked for (µs), None when unset; ValueError for a value that is not an int ≥ 0."""
    return micros_from_env(ENV, 0, environ)


def pace(bindings: Any, delay_us: int) -> bool:
    """Make every agent `bindings.nixlAgent` builds use `delay_us` (False: already paced)."""
    def wrap(make: Any) -> Any:
        def paced(name: str, config: Any) -> Any:
            config.pthrDelay = delay_us
            return make(name, config)
        return paced

    return patch_once(bindings, "nixlAgent", wrap)

def register() -> None:
    """The plugin's entry point (vLLM calls it in every process it starts; idempotent)."""
    delay = setting_or_warn(delay_from_env, LOG, "shadow nixlpace", "NIXL left as it is")
    if delay is None:
        return
    os.environ.setdefault("UCX_RCACHE_MAX_UNRELEASED", "1024")  # vLLM's own default, set pre-import
    try:
        from nixl._api import nixl_agent
    except ImportError:
        return
    if pace(sys.modules[nixl_agent.__module__].nixlBind, delay):
        LOG.info("shadow nixlpace: NIXL progress thread paced at %d µs", delay)

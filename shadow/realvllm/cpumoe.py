"""The variable-size collectives that vLLM 0.32's CPU backend lacks for an MoE model under data
parallelism, added to its `CpuCommunicator` in the servers shadow starts with `moe_dp_collectives`.

Why: with `--data-parallel-size > 1` every MoE layer gathers the ranks' tokens and scatters the
result back (`AgRsAll2AllManager.dispatch`/`combine` in `vllm/distributed/device_communicators/
all2all.py`, the only all2all manager `CpuCommunicator` selects), through `all_gatherv` and
`reduce_scatterv`, which `CpuCommunicator` does not implement: the base class raises
`NotImplementedError`, so the first forward pass kills both engines (vllm-project/vllm#57837; the
fix, PR #47778, is not in 0.32). Here: `all_gatherv` = Gloo `all_gather` of tensors padded to the
largest rank's rows, then trimmed; `reduce_scatterv` = Gloo `all_reduce`, then this rank's rows.
Same results as the GPU kernels, slower (the padding and the full all-reduce), and still one
collective per MoE layer per step across the ranks: the lockstep is vLLM's own.

How it gets in: `write_site_hook(dir)` writes a `sitecustomize.py` that installs `PostImportHook`;
with `dir` on `PYTHONPATH` every process of the server (API server, engine cores, workers) patches
`CpuCommunicator` right after vLLM imports it, and only the two missing methods.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

TARGET = "vllm.distributed.device_communicators.cpu_communicator"
SITE_HOOK = "import shadow.realvllm.cpumoe as _m\n_m.PostImportHook.install()\n"


def all_gatherv(self: Any, input_: Any, dim: int = 0, sizes: Sequence[int] | None = None) -> Any:
    """Concatenate every rank's rows along dim 0 (`sizes[r]` rows from rank r; equal when None)."""
    import torch
    import torch.distributed as dist

    if dim != 0:
        raise NotImplementedError("only dim 0 all-gatherv is supported")

    def one(t: Any) -> Any:
        rows = list(sizes) if sizes is not None else [int(t.shape[0])] * self.world_size
        top = max(rows)
        padded = t.new_zeros((top, *t.shape[1:]))
        padded[: t.shape[0]] = t
        parts = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(parts, padded, group=self.device_group)
        return torch.cat([p[:n] for p, n in zip(parts, rows, strict=True)], dim=0)

    if isinstance(input_, (list, tuple)):
        return [one(t) for t in input_]
    return one(input_)


def reduce_scatterv(self: Any, input_: Any, dim: int = -1, sizes: Sequence[int] | None = None) -> Any:
    """This rank's rows (`sizes[rank]` of them; equal shares when None) of the ranks' sum."""
    import torch.distributed as dist

    if dim < 0:
        dim += input_.dim()
    full = input_.movedim(0, dim).contiguous().clone()
    dist.all_reduce(full, group=self.device_group)
    rank = self.rank_in_group
    if sizes is not None:
        start, n = sum(sizes[:rank]), sizes[rank]
    else:
        n = full.shape[0] // self.world_size
        start = rank * n
    return full.narrow(0, start, n).movedim(0, dim).contiguous()


def patch(module: ModuleType) -> bool:
    """Give the module's CpuCommunicator the two methods it lacks (False: it has its own)."""
    cls = module.CpuCommunicator
    added = False
    for name, fn in (("all_gatherv", all_gatherv), ("reduce_scatterv", reduce_scatterv)):
        if name not in cls.__dict__:
            setattr(cls, name, fn)
            added = True
    return added


class PostImportHook(importlib.abc.MetaPathFinder):
    """Runs `patch` on TARGET as soon as it has been executed (wherever it is imported from)."""

    @classmethod
    def install(cls) -> None:
        if TARGET in sys.modules:
            patch(sys.modules[TARGET])
        elif not any(isinstance(f, cls) for f in sys.meta_path):
            sys.meta_path.insert(0, cls())

    def find_spec(self, fullname: str, path: Any,
                  target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != TARGET:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            patch(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def write_site_hook(directory: Path) -> Path:
    """Write `sitecustomize.py` (installing the hook) into `directory`; put it on PYTHONPATH."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "sitecustomize.py"
    path.write_text(SITE_HOOK)
    return directory

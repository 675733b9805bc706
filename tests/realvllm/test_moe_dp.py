"""One API server per DP rank (`VllmFleetConfig(dp_ports=True)`) and the CPU collectives an MoE
model needs under DP (`shadow.realvllm.cpumoe`): the launcher's plan, the collectives against
their definition on a real two-process Gloo group, and the hook patching vLLM's own
CpuCommunicator. No server is started (bench/bench_moe_dp.py runs a real MoE DP=2 server)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from shadow.realvllm.cpumoe import write_site_hook
from shadow.realvllm.launcher import VllmFleet, VllmFleetConfig, quiet_port

COLLECTIVES = r"""
import json, sys, types
import torch, torch.distributed as dist
import torch.multiprocessing as mp
from shadow.realvllm.cpumoe import all_gatherv, reduce_scatterv

SIZES = [3, 5]

def rank_main(rank, port, out):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    me = types.SimpleNamespace(world_size=2, rank_in_group=rank, device_group=None)
    mine = torch.arange(SIZES[rank] * 2, dtype=torch.float32).reshape(SIZES[rank], 2) + 100 * rank
    gathered = all_gatherv(me, [mine, mine[:, :1].clone()], 0, SIZES)
    full = torch.arange(16, dtype=torch.float32).reshape(8, 2) * (rank + 1)
    scattered = reduce_scatterv(me, full, 0, SIZES)
    out.put((rank, gathered[0].tolist(), gathered[1].tolist(), scattered.tolist()))
    dist.destroy_process_group()

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=rank_main, args=(r, int(sys.argv[1]), q)) for r in range(2)]
    for p in ps: p.start()
    got = sorted(q.get(timeout=120) for _ in ps)
    for p in ps: p.join(60)
    print(json.dumps(got))
"""


def test_dp_ports_plans_one_api_server_per_rank(engine_venv: Path, tmp_path: Path) -> None:
    fleet = VllmFleet(VllmFleetConfig(decode=1, data_parallel=2, dp_ports=True, moe_dp_collectives=True,
                                      model_path=tmp_path / "model", cores=(0, 1), probe_url="http://127.0.0.1:9",
                                      log_dir=tmp_path / "logs", venv=engine_venv), log=lambda m: None)
    servers = fleet.plan()
    assert [s.name for s in servers] == ["decode/0.0", "decode/0.1"]
    assert len({s.port for s in servers}) == 2
    fleet.servers = servers
    assert fleet.ready_line() == {"prefill": [], "decode": [s.url for s in servers]}
    rpc = set()
    for r, s in enumerate(servers):
        argv = s.argv
        assert argv[argv.index("--data-parallel-rank") + 1] == str(r)
        assert argv[argv.index("--data-parallel-size") + 1] == "2"
        assert argv[argv.index("--data-parallel-size-local") + 1] == "1"
        assert argv[argv.index("--port") + 1] == str(s.port)
        rpc.add(argv[argv.index("--data-parallel-rpc-port") + 1])
        assert "--api-server-count" not in argv  # external LB: one API server per rank by itself
        assert s.env["VLLM_CPU_OMP_THREADS_BIND"] == str(r)  # rank r on core r, not all on core 0
        assert s.env["SHADOW_PROBE_WORKER"] == f"d{r}"
        hook = Path(s.env["PYTHONPATH"].split(os.pathsep)[0])
        assert (hook / "sitecustomize.py").read_text().startswith("import shadow.realvllm.cpumoe")
    assert len(rpc) == 1  # the ranks of one server meet at one DP RPC port


def test_dp_ports_needs_two_ranks_and_counts_ports_per_rank() -> None:
    for bad in ({"data_parallel": 1, "dp_ports": True},
                {"decode": 1, "data_parallel": 2, "dp_ports": True, "ports": (18000,)}):
        try:
            VllmFleetConfig(**bad)
        except ValueError as exc:
            assert "dp_ports" in str(exc) or "ports: need 2" in str(exc)
        else:
            raise AssertionError(f"{bad} was accepted")
    assert VllmFleetConfig(data_parallel=2, dp_ports=True, decode=1, ports=(18000, 18001)).ranks_per_port == 2


def test_cpu_collectives_on_a_real_gloo_group(engine_venv: Path, tmp_path: Path) -> None:
    script = tmp_path / "collectives.py"
    script.write_text(COLLECTIVES)
    done = subprocess.run([str(engine_venv / "bin" / "python"), str(script), str(quiet_port())],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    rank0 = [[float(i * 2), float(i * 2 + 1)] for i in range(3)]
    rank1 = [[float(i * 2 + 100), float(i * 2 + 101)] for i in range(5)]
    summed = [[3.0 * (2 * i), 3.0 * (2 * i + 1)] for i in range(8)]  # rank 0's x1 + rank 1's x2
    for rank, gathered, first_col, scattered in got:
        assert gathered == rank0 + rank1  # every rank's rows, in rank order, uneven sizes kept
        assert first_col == [[row[0]] for row in rank0 + rank1]
        assert scattered == (summed[:3] if rank == 0 else summed[3:])  # this rank's rows of the sum


def test_hook_gives_vllms_cpu_communicator_the_missing_collectives(engine_venv: Path, tmp_path: Path) -> None:
    hook = write_site_hook(tmp_path / "hook")
    probe = ("import vllm.distributed.device_communicators.cpu_communicator as m;"
             "import shadow.realvllm.cpumoe as c;"
             "k = m.CpuCommunicator;"
             "print(k.all_gatherv is c.all_gatherv, k.reduce_scatterv is c.reduce_scatterv)")
    env = dict(os.environ, PYTHONPATH=str(hook))
    done = subprocess.run([str(engine_venv / "bin" / "python"), "-c", probe], capture_output=True, text=True,
                          timeout=300, check=False, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-2:] == ["True", "True"]
    without = dict(os.environ)
    without.pop("PYTHONPATH", None)
    plain = subprocess.run([str(engine_venv / "bin" / "python"), "-c", probe], capture_output=True, text=True,
                           timeout=300, check=False, env=without)
    assert plain.stdout.split()[-2:] == ["False", "False"]  # vLLM 0.32 as shipped: the base class raises

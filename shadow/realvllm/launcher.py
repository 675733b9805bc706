"""Start and stop a fleet of real vLLM CPU servers: G decode servers and optional prefill servers in
a P/D pair (NixlConnector, or ExampleConnector where NIXL is absent), each bound to one core, on free
loopback ports, with small KV and `--enforce-eager`.

Every server runs in its own process group; `stop()` signals the groups (SIGTERM, then SIGKILL) and
waits until no process of any group is left. `start()` waits on every server's /health at once and,
when one does not come up, stops them all and raises `StartError` naming it with its log's tail.

    with VllmFleet(VllmFleetConfig(decode=2)) as fleet:
        fleet.ready_line()   # {"prefill": [], "decode": ["http://127.0.0.1:PORT", ...]}

With `data_parallel=N, dp_ports=True` a decode server's N DP ranks each get an API server of their
own (vLLM's external-LB mode: `--data-parallel-rank r --data-parallel-size-local 1`, one process
group, core and port per rank, the ranks of one server still one DP group, stepping together for an
MoE model), and each rank is a decode worker of the ready line (`d0`, `d1`, ... in order).
`moe_dp_collectives` adds the collectives vLLM 0.32's CPU backend lacks for MoE under DP
(`shadow.realvllm.cpumoe`).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import httpx

from shadow.base.knobs import AT_LEAST_ONE, POSITIVE_S, check_knobs, knob
from shadow.base.procs import log_tail
from shadow.realvllm.cpumoe import write_site_hook
from shadow.realvllm.model import SIZES
from shadow.realvllm.nixlpace import ENV as NIXL_PACE_ENV
from shadow.realvllm.shmpace import ENV as SHM_PACE_ENV

ENV_VENV = "SHADOW_VLLM_VENV"
NIXL_PROGRESS_DELAY_US = 1000  # NIXL's progress thread's sleep between polls in the servers
#: vLLM's message-queue readers' sleep between checks where they would spin (shadow.realvllm.shmpace);
#: the servers' environment's own value wins (empty: off)
SHM_SPIN_SLEEP_US = 100
DEFAULT_KV_BYTES = 128 << 20
CONNECTORS = ("auto", "nixl", "example")  # P/D KV connectors (without prefill servers: none is used)
MODEL_SIZES = tuple(SIZES)  # the built-in models: tiny, mid, moe
INSTALL_HINT = "install the engine tier with scripts/install-vllm.sh (or set SHADOW_VLLM_VENV to its venv)"


class StartError(RuntimeError):
    """A server of the fleet did not come up (the message names it and quotes its log)."""


def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def find_engine_venv(explicit: str | os.PathLike[str] | None = None) -> Path:
    """The venv that has vLLM: `explicit`, else $SHADOW_VLLM_VENV (either one, when given, is the
    only place looked at), else the repository's .venv-vllm or the running interpreter's own;
    FileNotFoundError saying how to install it otherwise."""
    given = explicit or os.environ.get(ENV_VENV)
    candidates = [Path(given)] if given else [repo_root() / ".venv-vllm", Path(sys.prefix)]
    for venv in candidates:
        if (venv / "bin" / "vllm").exists() and (venv / "bin" / "python").exists():
            return venv
    tried = ", ".join(str(c) for c in candidates)
    raise FileNotFoundError(f"no vLLM engine venv found (looked in {tried}): {INSTALL_HINT}")


def nixl_available(venv: Path) -> bool:
    """True when the engine venv can import NIXL (so NixlConnector can work)."""
    probe = subprocess.run([str(venv / "bin" / "python"), "-c", "import nixl"],
                           capture_output=True, timeout=120, check=False)
    return probe.returncode == 0


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (the server binds it itself)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def quiet_port(host: str = "127.0.0.1", tries: int = 200) -> int:
    """A free port below the kernel's ephemeral range, for a server that binds it long after it is
    chosen (NIXL's side channel, after the model loads): a port from bind(0) is in that range, where
    any outgoing connection may take it meanwhile (a tier P/D start failed so: address in use)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as fh:
            low = int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    for _ in range(tries):
        port = rng.randrange(10000, max(10001, low))
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        return port
    return free_port(host)


def free_port_run(n: int, host: str = "127.0.0.1", tries: int = 200) -> int:
    """The first of `n` consecutive ports that were all free a moment ago."""
    for _ in range(tries):
        base = free_port(host)
        if base + n > 65535:
            continue
        socks: list[socket.socket] = []
        try:
            for p in range(base, base + n):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(s)
                s.bind((host, p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise OSError(f"no run of {n} free ports found on {host}")


def ensure_model(venv: Path, size: str, seed: int, models_dir: Path | None = None) -> Path:
    """The model directory for (size, seed), built by the engine venv's builder if not cached."""
    argv = [str(venv / "bin" / "python"), "-m", "shadow.realvllm.model", "--size", size, "--seed", str(seed)]
    if models_dir is not None:
        argv += ["--models-dir", str(models_dir)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        raise StartError(f"the model builder failed ({' '.join(argv)}):\n{done.stderr.strip()[-2000:]}")
    return Path(done.stdout.strip().splitlines()[-1])


@dataclass(frozen=True)
class VllmFleetConfig:
    """What to start; defaults fit a 2-core machine (tiny model, 128 MiB of KV per server).

    The settings of `shadow fleet --engine vllm`'s own group are declared once, as knobs here
    (`shadow.base.knobs`): flag, type, default, help, bound or choices; the command derives its
    flags from them, and a value out of bounds is a ValueError naming the flag. The fleet's shape
    (`decode`, `prefill`, `host`, `served_model_name`, `max_num_seqs`, `max_model_len`) comes from
    `shadow fleet`'s shared flags (FleetConfig's); `probe_url`, `probe_token` and `venv` from flags
    of the command's own (their defaults are read from the environment). Checks across fields stay
    in `__post_init__`."""

    decode: int = 2
    prefill: int = 0
    host: str = "127.0.0.1"
    served_model_name: str = "sim-llm"
    # None: the builder's model for (model_size, model_seed). (RUF009: a knob is a dataclasses.field)
    model_path: Path | None = knob(  # noqa: RUF009
        None, "--model-path", "serve this model directory instead of building one", type=Path, metavar="DIR")
    model_size: str = knob("tiny", "--model-size", "the built-in random model: tiny (fast), mid (~20 ms "
                           "steps) or moe (tiny with 4 experts per layer)", choices=MODEL_SIZES)
    model_seed: int = knob(0, "--model-seed", "seed of the built model")
    models_dir: Path | None = None
    data_parallel: int = knob(1, "--data-parallel", "DP engines per decode server (vLLM's "
                              "--data-parallel-size, one core each; its /metrics labels each engine)",
                              AT_LEAST_ONE, metavar="N")
    # one API server (port, decode worker) per DP rank: external-LB mode
    dp_ports: bool = knob(False, "--dp-ports", "with --data-parallel N: one API server (port, core, decode "
                          "worker of the ready line) per DP rank, vLLM's external-LB mode; the ranks stay "
                          "one DP group")
    # add the CPU collectives an MoE model needs under DP (cpumoe)
    moe_dp_collectives: bool = knob(False, "--moe-dp-collectives", "add the CPU collectives vLLM 0.32 lacks "
                                    "for an MoE model under DP (all_gatherv, reduce_scatterv; without them "
                                    "--model-size moe --data-parallel 2 dies on its first forward pass)")
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None  # a step's token budget (None: vLLM's default, 2048 on CPU)
    max_model_len: int = 2048
    kv_bytes: int = knob(DEFAULT_KV_BYTES, "--kv-bytes", "KV cache per server in bytes (128 MiB: 131k "
                         "tokens of the tiny model)", AT_LEAST_ONE, metavar="BYTES")
    # P/D connector when prefill > 0: auto = NIXL if it imports, else Example
    connector: str = knob("auto", "--connector", "P/D KV connector with --prefill (auto: NIXL when it "
                          "imports, else ExampleConnector)", choices=CONNECTORS)
    cores: tuple[int, ...] | None = None  # core of server i = cores[i % len]; default: all cores
    ports: tuple[int, ...] | None = None  # port of each server, prefill ones first; default: free ports
    probe_url: str | None = None  # shadow serve's event API: the step probe posts there
    probe_token: str | None = None
    venv: Path | None = None
    log_dir: Path | None = knob(  # noqa: RUF009
        None, "--log-dir", "where each server's log goes (none: a new temporary directory)", type=Path,
        metavar="DIR")
    start_timeout_s: float = knob(600.0, "--start-timeout", "seconds every server has to answer /health",
                                  POSITIVE_S, metavar="S")
    stop_grace_s: float = 20.0
    extra_args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()  # more environment for every server (e.g. SHADOW_PROBE_QUEUE)

    def __post_init__(self) -> None:
        check_knobs(self)  # every setting within its bound or choices, naming its flag
        if self.decode < 1 or self.prefill < 0:
            raise ValueError("need at least one decode server and a non-negative prefill count")
        if self.host not in ("127.0.0.1", "localhost"):
            raise ValueError("real vLLM servers bind loopback only (their admin surface has no token)")
        if self.dp_ports and self.data_parallel < 2:
            raise ValueError("dp_ports (--dp-ports) needs data_parallel (--data-parallel) >= 2 "
                             "(one API server per DP rank)")
        if self.ports is not None and len(self.ports) != self.prefill + self.decode * self.ranks_per_port:
            n = self.prefill + self.decode * self.ranks_per_port
            raise ValueError(f"ports: need {n} (prefill first, then each decode API server), "
                             f"got {len(self.ports)}")

    @property
    def ranks_per_port(self) -> int:
        """API servers per decode server: its DP ranks with dp_ports, else 1."""
        return self.data_parallel if self.dp_ports else 1


@dataclass
class Server:
    """One vLLM server process (its own process group)."""

    name: str  # "prefill/0", "decode/1"
    worker: str  # the worker name its step probe reports ("p0", "d1")
    port: int
    core: int
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    _log: IO[bytes] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self._log = self.log_path.open("ab")
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=self.env, process_group=0)

    def tail(self, lines: int = 25) -> str:
        last = log_tail(self.log_path, lines)
        return "(no log)" if last is None else "\n".join(last)

    def signal_group(self, sig: int) -> bool:
        """Send `sig` to the server's process group; False when no process of it is left."""
        if self.proc is None:
            return False
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            return False
        return True


class VllmFleet:
    """Real vLLM servers as a fleet; `start()` returns when every /health answers 200."""

    def __init__(self, config: VllmFleetConfig, log: Callable[[str], None] | None = None) -> None:
        self.config = config
        self.log = log or (lambda msg: print(f"shadow fleet: {msg}", file=sys.stderr, flush=True))
        self.venv = find_engine_venv(config.venv)
        self.servers: list[Server] = []
        self.connector: str | None = None
        self.model_path: Path | None = None
        self.log_dir = config.log_dir or Path(tempfile.mkdtemp(prefix="shadow-vllm-"))

    @property
    def prefill_urls(self) -> list[str]:
        return [s.url for s in self.servers if s.name.startswith("prefill/")]

    @property
    def decode_urls(self) -> list[str]:
        return [s.url for s in self.servers if s.name.startswith("decode/")]

    def ready_line(self) -> dict[str, Any]:
        return {"prefill": self.prefill_urls, "decode": self.decode_urls}

    # -- building the commands ---------------------------------------------------------------------
    def _connector(self) -> str | None:
        cfg = self.config
        if cfg.prefill == 0:
            return None
        if cfg.connector != "auto":
            return cfg.connector
        return "nixl" if nixl_available(self.venv) else "example"

    def _kv_config(self, role: str) -> str | None:
        kv_role = "kv_producer" if role == "prefill" else "kv_consumer"
        if self.connector == "nixl":
            return json.dumps({"kv_connector": "NixlConnector", "kv_role": kv_role,
                               "kv_buffer_device": "cpu"})
        if self.connector == "example":
            shared = self.log_dir / "kv-shared"
            shared.mkdir(exist_ok=True)
            return json.dumps({"kv_connector": "ExampleConnector", "kv_role": kv_role,
                               "kv_connector_extra_config": {"shared_storage_path": str(shared)}})
        return None

    def _env(self, core: int | str, worker: str) -> dict[str, str]:
        cfg = self.config
        env = dict(os.environ)
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # overrides --kv-cache-memory-bytes; "" crashes
        env.update({
            "VLLM_HOST_IP": "127.0.0.1",  # else the engine's message queue binds the host's address
            # "auto" would pin every server to core 0; a DP server gets one core per engine ("0|1")
            "VLLM_CPU_OMP_THREADS_BIND": str(core),
            "PYTHONUNBUFFERED": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
        })
        # an engine core and its worker would each keep a thread spinning (shadow.realvllm.shmpace)
        env.setdefault(SHM_PACE_ENV, str(SHM_SPIN_SLEEP_US))
        for k in ("SHADOW_PROBE_URL", "SHADOW_PROBE_TOKEN", "SHADOW_PROBE_WORKER"):
            env.pop(k, None)
        if cfg.probe_url:
            env["SHADOW_PROBE_URL"] = cfg.probe_url
            env["SHADOW_PROBE_WORKER"] = worker
            if cfg.probe_token:
                env["SHADOW_PROBE_TOKEN"] = cfg.probe_token
        env.update(dict(cfg.env))
        if self.connector == "nixl":
            env.update({"UCX_NET_DEVICES": "lo", "UCX_TLS": "tcp,self,sm",
                        # NIXL's progress thread would spin a core per server (shadow.realvllm.nixlpace)
                        NIXL_PACE_ENV: str(NIXL_PROGRESS_DELAY_US),
                        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(quiet_port())})
        return env

    def _argv(self, model: Path, port: int, role: str, rank: tuple[int, int] | None = None) -> list[str]:
        """The server's command; `rank` = (DP rank, DP RPC port) of one external-LB rank server."""
        cfg = self.config
        argv = [str(self.venv / "bin" / "vllm"), "serve", str(model),
                "--served-model-name", cfg.served_model_name, "--host", "127.0.0.1", "--port", str(port),
                "--max-model-len", str(cfg.max_model_len), "--max-num-seqs", str(cfg.max_num_seqs),
                *(("--max-num-batched-tokens", str(cfg.max_num_batched_tokens))
                  if cfg.max_num_batched_tokens is not None else ()),
                "--dtype", "float32", "--enforce-eager", "--kv-cache-memory-bytes", str(cfg.kv_bytes)]
        if cfg.probe_url:
            # The probe (a stat logger) keeps the engine's stats on, so /metrics is still served;
            # --disable-log-stats only drops vLLM's text logger, which with iteration details would
            # log every step.
            argv += ["--disable-log-stats", "--enable-logging-iteration-details"]
        kv = self._kv_config(role)
        if kv is not None:
            argv += ["--kv-transfer-config", kv]
        if rank is not None:
            # vLLM's external-LB DP (what --data-parallel-multi-port-external-lb's supervisor runs,
            # but one process per rank here: the supervisor hands every rank the same
            # VLLM_CPU_OMP_THREADS_BIND and both engines bound to core 0).
            argv += ["--data-parallel-size", str(cfg.data_parallel), "--data-parallel-rank", str(rank[0]),
                     "--data-parallel-size-local", "1", "--data-parallel-address", "127.0.0.1",
                     "--data-parallel-rpc-port", str(rank[1])]
        elif role == "decode" and cfg.data_parallel > 1:
            # One API server for all the engines (vLLM 0.32 defaults to one per engine, and then
            # serves /metrics from its multiprocess registry: the load gauges come out empty and
            # no collector of a stat logger, shadow's probe among them, is on the page).
            argv += ["--data-parallel-size", str(cfg.data_parallel), "--api-server-count", "1"]
        return argv + list(cfg.extra_args)

    def plan(self) -> list[Server]:
        """The servers to start (model resolved, ports picked); nothing is started yet."""
        cfg = self.config
        self.model_path = cfg.model_path or ensure_model(self.venv, cfg.model_size, cfg.model_seed,
                                                         cfg.models_dir)
        self.connector = self._connector()
        cores = cfg.cores or tuple(sorted(os.sched_getaffinity(0)))
        servers: list[Server] = []
        roles = [("prefill", i, f"p{i}") for i in range(cfg.prefill)]
        roles += [("decode", g, f"d{g}") for g in range(cfg.decode)]
        slot = 0
        ports = list(cfg.ports) if cfg.ports else None
        for role, i, worker in roles:
            width = cfg.data_parallel if role == "decode" else 1
            mine = [cores[(slot + k) % len(cores)] for k in range(width)]
            slot += width
            if role == "decode" and cfg.dp_ports:
                servers += self._rank_servers(i, mine, ports)
                continue
            port = ports.pop(0) if ports else quiet_port()
            servers.append(Server(
                name=f"{role}/{i}", worker=worker, port=port, core=mine[0],
                argv=self._argv(self.model_path, port, role),
                env=self._with_collectives(self._env("|".join(map(str, mine)), worker))
                if role == "decode" and width > 1 else self._env("|".join(map(str, mine)), worker),
                log_path=self.log_dir / f"{role}-{i}.log",
            ))
        return servers

    def _with_collectives(self, env: dict[str, str]) -> dict[str, str]:
        """`env` with shadow.realvllm.cpumoe's import hook on PYTHONPATH when moe_dp_collectives."""
        if not self.config.moe_dp_collectives:
            return env
        hook = write_site_hook(self.log_dir / "pyhook")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(hook), env.get("PYTHONPATH")) if p)
        return env

    def _rank_servers(self, g: int, cores: list[int], ports: list[int] | None) -> list[Server]:
        """Decode server g as one API server per DP rank (dp_ports): rank r on cores[r], worker
        d{g*N+r}; the ranks share one DP RPC port (rank 0's front end hosts the coordinator)."""
        assert self.model_path is not None
        n = self.config.data_parallel
        rpc = quiet_port()
        out = []
        for r in range(n):
            port = ports.pop(0) if ports else quiet_port()
            worker = f"d{g * n + r}"
            env = self._with_collectives(self._env(str(cores[r]), worker))
            out.append(Server(
                name=f"decode/{g}.{r}", worker=worker, port=port, core=cores[r],
                argv=self._argv(self.model_path, port, "decode", (r, rpc)), env=env,
                log_path=self.log_dir / f"decode-{g}-rank{r}.log",
            ))
        return out

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        self.servers = self.plan()
        self.log(f"starting {len(self.servers)} vLLM server(s) ({self.connector or 'no'} KV connector, "
                 f"model {self.model_path}); logs in {self.log_dir}")
        try:
            for s in self.servers:
                s.start()
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        self.log("ready: " + ", ".join(f"{s.name} {s.url} (core {s.core})" for s in self.servers))

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.config.start_timeout_s
        pending = list(self.servers)
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            while pending:
                for s in list(pending):
                    assert s.proc is not None
                    if s.proc.poll() is not None:
                        raise StartError(f"vLLM server {s.name} (port {s.port}) exited with code "
                                         f"{s.proc.returncode} before it was healthy; "
                                         f"{s.log_path}:\n{s.tail()}")
                    try:
                        healthy = client.get(f"{s.url}/health").status_code == 200
                    except httpx.HTTPError:
                        healthy = False
                    if healthy and not group_listens_on(s.proc.pid, s.port):
                        raise StartError(f"port {s.port} answers, but not from vLLM server {s.name}: another "
                                         f"process listens there; {s.log_path}:\n{s.tail()}")
                    if healthy:
                        pending.remove(s)
                if not pending:
                    return
                if time.monotonic() > deadline:
                    s = pending[0]
                    raise StartError(f"vLLM server {s.name} (port {s.port}) was not healthy within "
                                     f"{self.config.start_timeout_s:.0f} s; {s.log_path}:\n{s.tail()}")
                time.sleep(0.5)

    def stop(self) -> None:
        """Stop every server's process group (SIGTERM, then SIGKILL) and wait until none is left."""
        live = [s for s in self.servers if s.signal_group(signal.SIGTERM)]
        deadline = time.monotonic() + self.config.stop_grace_s
        for s in live:
            assert s.proc is not None
            with contextlib.suppress(subprocess.TimeoutExpired):
                s.proc.wait(max(0.1, deadline - time.monotonic()))
        for s in live:
            _reap_group(s, deadline)
        for s in self.servers:
            if s._log is not None:
                s._log.close()
                s._log = None

    def __enter__(self) -> VllmFleet:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def processes() -> Iterator[tuple[int, bytes, int]]:
    """(pid, state, process group) of every process (Linux /proc)."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2 :].split()  # after "pid (comm) ": state ppid pgrp ...
        if len(fields) > 2:
            yield int(entry.name), fields[0], int(fields[2])


def group_members(pgid: int) -> list[int]:
    """PIDs of the live (not zombie) processes in process group `pgid`."""
    return [pid for pid, state, pgrp in processes() if state != b"Z" and pgrp == pgid]


def listening_inodes(port: int) -> set[int]:
    """Socket inodes of the TCP listeners on `port`, any address (Linux /proc/net/tcp and tcp6)."""
    found: set[int] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table, encoding="ascii") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()  # sl local_address rem_address st ... uid timeout inode
            if len(cols) > 9 and cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                found.add(int(cols[9]))
    return found


def group_listens_on(pgid: int, port: int) -> bool:
    """Whether a process of group `pgid` holds a socket listening on `port`: a server's health
    answer is its own only then (another process may have bound the port it was given)."""
    wanted = {f"socket:[{inode}]" for inode in listening_inodes(port)}
    for pid in group_members(pgid) if wanted else ():
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{pid}/fd/{fd}") in wanted:
                    return True
    return False


def _reap_group(s: Server, deadline: float) -> None:
    """Wait for the group's other processes (engine cores) until `deadline`, then SIGKILL the group
    and wait until no live process of it is left."""
    assert s.proc is not None
    pgid = s.proc.pid
    while time.monotonic() < deadline and group_members(pgid):
        time.sleep(0.1)
    if group_members(pgid):
        s.signal_group(signal.SIGKILL)
        end = time.monotonic() + 10.0
        while group_members(pgid) and time.monotonic() < end:
            time.sleep(0.05)
    if s.proc.poll() is None:
        s.proc.wait(5)

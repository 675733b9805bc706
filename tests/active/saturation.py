"""One seeded saturating workload through `shadow serve --active` per policy, measured on the
simulated fleet's own ground truth (its shared step clock: Σ over steps of max_g L_g − min_g L_g).

Protocol: a fleet of P prefill servers and G decode ranks × B slots (real process); per policy a
fresh `shadow serve --active --active-policy POLICY` (real process, taps in front of every worker);
N requests from one seeded generator (prompt words lognormal, clipped; max_tokens lognormal,
clipped; ignore_eos so each yields exactly max_tokens), sent by the official `openai` async client
as a closed loop of C = ⌈depth·G·B⌉ concurrent streams (the pool never runs dry: saturation).
Average spread = Δ shadow_fleet_spread_token_steps_total / Δ shadow_fleet_steps_total over the
saturated window (from when request C is sent to when the last one is sent: warm-up and drain
excluded); occupancy = the share of the decode slots running a request over the same steps (the
clock's busy_slot_steps / slot_steps, after admission): whether the window really was saturated;
throughput = generated tokens / wall seconds of the whole run.

Saturation is the fleet's, not the client's: C streams in flight keep the G·B slots busy only
while the rest of the pipeline (client, proxy, taps, prefill, KV hand-over) takes a small part of a
request's decode time. The fleet's steps run in real time; a CPU-starved client and proxy do not
keep up with them. On the shared 2-core machine (2026-12-01, six or ten CPU burners, load ≈ 12–15),
at time-scale 0.5 (≈ 10 ms steps) occupancy fell to 0.55–0.63 and BR-0's spread equalled or
exceeded JSQ's (1,452 vs 1,443; 1,498 vs 1,420): with free slots there is no pool to choose from.
Without the burners (load 4–9): occupancy 0.95–0.99, BR-0 925–1,088 vs JSQ 1,542–1,565. At
time-scale 1.0 (≈ 20 ms steps), ten burners: occupancy 0.85–0.88, BR-0 1,305 vs JSQ 1,749.

    python -m tests.active.saturation      # prints the table (defaults = the test's protocol)
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import openai

from tests.active.procs import shadow_process

POLICIES = ("jsq-bytes", "br0", "brh")


@dataclass(frozen=True)
class Job:
    words: int
    max_tokens: int


def workload(n: int, seed: int, prompt_median: float = 400, output_median: float = 60) -> list[Job]:
    """N jobs: prompt words lognormal(median, σ=1) in [16, 3000], max_tokens lognormal(median, σ=0.9)
    in [4, 2000]."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = int(min(3000, max(16, rng.lognormvariate(math.log(prompt_median), 1.0))))
        mt = int(min(2000, max(4, rng.lognormvariate(math.log(output_median), 0.9))))
        out.append(Job(words, mt))
    return out


def fleet_counter(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{url}/metrics has no {name}")


@dataclass
class RunResult:
    policy: str
    spread: float
    steps: float
    tokens: int
    seconds: float
    exact: bool  # every stream produced exactly its max_tokens
    occupancy: float  # share of the decode slots busy over the window's steps (1 = saturated)

    @property
    def throughput(self) -> float:
        return self.tokens / self.seconds


def _ground_truth(probe: str) -> tuple[float, float, float, float]:
    """(spread token-steps, steps, busy slot-steps, slot-steps) of the fleet's shared clock."""
    clock = httpx.get(probe + "/fleet/state", timeout=10).json()["clock"]
    return (
        fleet_counter(probe, "shadow_fleet_spread_token_steps_total"),
        fleet_counter(probe, "shadow_fleet_steps_total"),
        float(clock["busy_slot_steps"]),
        float(clock["slot_steps"]),
    )


async def _drive(
    url: str, jobs: Sequence[Job], concurrency: int, probe: str, warm: int, marks: list[tuple[float, ...]]
) -> tuple[int, bool]:
    """Closed loop of `concurrency` streams; `marks` gets the fleet's counters when request `warm`
    is sent and when the last one is sent (the saturated window)."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=300)
    it = iter(enumerate(jobs))
    tokens = 0
    exact = True

    async def worker() -> None:
        nonlocal tokens, exact
        for i, job in it:
            if i in (warm, len(jobs) - 1):
                marks.append(await asyncio.to_thread(_ground_truth, probe))
            stream = await client.completions.create(
                model="sim-llm",
                prompt=f"r{i} " + "w " * job.words,
                max_tokens=job.max_tokens,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            n = 0
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].text:
                    n += 1
            tokens += n
            exact = exact and n == job.max_tokens

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    await client.close()
    return tokens, exact


def serve_args(fleet: dict[str, Any], slots: int, policy: str, extra: Sequence[str] = ()) -> list[str]:
    args = [
        "serve",
        "--slots",
        str(slots),
        "--active",
        "--active-policy",
        policy,
        "--pin-mode",  # the comparison must not be cut by automatic fallback (slow decisions under load)
        "--scrape-interval",
        "1",
        *extra,
    ]
    for i, u in enumerate(fleet["decode"]):
        args += ["--upstream", f"d{i}={u}"]
    for i, u in enumerate(fleet["prefill"]):
        args += ["--prefill", f"p{i}={u}"]
    return args


def run_policy(
    fleet: dict[str, Any],
    slots: int,
    policy: str,
    jobs: Sequence[Job],
    depth: float,
    extra: Sequence[str] = (),
) -> RunResult:
    probe = fleet["decode"][0]
    with shadow_process(serve_args(fleet, slots, policy, extra)) as (_, ready):
        t0 = time.perf_counter()
        concurrency = math.ceil(depth * len(fleet["decode"]) * slots)
        marks: list[tuple[float, ...]] = []
        tokens, exact = asyncio.run(_drive(ready["active"], jobs, concurrency, probe, concurrency, marks))
        seconds = time.perf_counter() - t0
    (s0, k0, b0, n0), (s1, k1, b1, n1) = marks
    steps = k1 - k0
    occupancy = (b1 - b0) / (n1 - n0) if n1 > n0 else 0.0
    return RunResult(policy, (s1 - s0) / steps if steps else 0.0, steps, tokens, seconds, exact, occupancy)


def fleet_args(prefill: int, decode: int, slots: int, time_scale: float) -> list[str]:
    return [
        "fleet",
        "--prefill",
        str(prefill),
        "--decode",
        str(decode),
        "--slots",
        str(slots),
        "--port",
        "0",
        "--time-scale",
        str(time_scale),
    ]


def compare(
    n: int,
    seed: int,
    prefill: int = 2,
    decode: int = 4,
    slots: int = 8,
    time_scale: float = 0.25,
    policies: Sequence[str] = POLICIES,
    depth: float = 2.0,
    prompt_median: float = 400,
    output_median: float = 60,
    extra: Sequence[str] = (),
) -> list[RunResult]:
    """The same seeded workload through one fleet, one fresh `shadow serve --active` per policy."""
    jobs = workload(n, seed, prompt_median, output_median)
    with shadow_process(fleet_args(prefill, decode, slots, time_scale)) as (_, fleet):
        return [run_policy(fleet, slots, p, jobs, depth, extra) for p in policies]


def table(results: Sequence[RunResult]) -> str:
    lines = [
        f"{'policy':8} {'avg spread (tokens)':>20} {'steps':>8} {'occupancy':>9} {'tokens':>8} "
        f"{'seconds':>8} {'tok/s':>8} exact"
    ]
    for r in results:
        lines.append(
            f"{r.policy:8} {r.spread:20.1f} {r.steps:8.0f} {r.occupancy:9.3f} {r.tokens:8d} "
            f"{r.seconds:8.2f} {r.throughput:8.1f} {r.exact}"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=200)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--prefill", type=int, default=2)
    p.add_argument("--decode", type=int, default=4)
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--depth", type=float, default=2.0, help="concurrent streams per decode slot")
    p.add_argument("--prompt-median", type=float, default=200)
    p.add_argument("--output-median", type=float, default=100)
    p.add_argument(
        "--serve-args", default="--policies br0", help="extra `shadow serve` flags, e.g. '--dispatch-ahead 1'"
    )
    a = p.parse_args()
    extra = a.serve_args.split()
    res = compare(
        a.n,
        a.seed,
        a.prefill,
        a.decode,
        a.slots,
        a.time_scale,
        depth=a.depth,
        prompt_median=a.prompt_median,
        output_median=a.output_median,
        extra=extra,
    )
    print(
        f"N={a.n} seed={a.seed} P={a.prefill} G={a.decode} B={a.slots} time-scale={a.time_scale} "
        f"C={math.ceil(a.depth * a.decode * a.slots)} prompt median={a.prompt_median} "
        f"output median={a.output_median} serve extra={extra}"
    )
    print(table(res))


if __name__ == "__main__":
    main()

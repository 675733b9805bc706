"""Human-readable replay output: the per-policy table and the comparison line (rich)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from shadow.contracts.report import BalanceFigures
from shadow.replay.experiment import ReplayReport


def _f(value: float | None, fmt: str) -> str:
    return "–" if value is None else format(value, fmt)


def pct(value: float | None) -> str:
    """A signed percentage with one decimal; never "-0.0%" (a change under 0.05% is "±0.0%")."""
    if value is None:
        return "–"
    rounded = round(value, 1)
    return "±0.0%" if rounded == 0 else f"{rounded:+.1f}%"


def ratio_phrase(ratio: float | None, what: str) -> str:
    """"2.10× lower" when ratio ≥ 1 (BR better), "1.20× higher" when worse (ratio = base / BR)."""
    if ratio is None:
        return f"{what}: no ratio (zero {what} in this lane)"
    if ratio >= 1.0:
        return f"{what} {ratio:.2f}× lower"
    return f"{what} {1.0 / ratio:.2f}× higher (worse)"


def comparison_lines(report: ReplayReport) -> list[str]:
    """One line per BR lane: spread ratio and throughput change against the best baseline."""
    comp = report.comparison()
    base = comp.get("best_baseline_spread")
    thr = comp.get("best_baseline_throughput")
    lines: list[str] = []
    for label, r in report.results.items():
        if r.policy not in ("br0", "brh"):
            continue
        item = comp.get(label)
        if base is None or thr is None or item is None:
            lines.append(f"{label}: no baseline lane in --policies to compare with "
                         f"(add e.g. jsq-bytes)")
            continue
        lines.append(
            f"{label}: {ratio_phrase(item['spread_reduction_x'], 'spread')} than the best baseline ({base}); "
            f"throughput {pct(item['throughput_gain_pct'])} vs the best baseline ({thr})"
        )
    return lines


def render_report(report: ReplayReport, console: Console) -> None:
    """Print the workload header, one row per lane, and BR's gain over the best baseline."""
    w = report.workload
    synthetic = " [bold yellow]— SYNTHETIC workload, not a real trace[/]" if w["synthetic"] else ""
    console.print(f"[bold]{w['name']}[/]{synthetic}")
    rho = w.get("rho")
    console.print(
        f"{w['requests']} requests, prompt mean {w['mean_prompt_tokens']:.0f}, output mean "
        f"{w['mean_output_tokens']:.0f}; rate {w['mean_rate_rps']:.3g} req/s = ρ {_f(rho, '.2f')} of "
        f"estimated capacity {w['estimated_capacity_rps']:.3g} req/s"
    )
    c = report.config
    console.print(
        f"G={c['workers']} workers × B={c['slots']} slots; step T = {c['step_a_s_per_token']:.3g}·max L + "
        f"{c['step_b_s']:.3g} s{_cost_terms(c)}; BR-H H={c['br']['horizon']} β={c['br']['beta']} "
        f"γ={c['br']['gamma']} R_max={c['br']['r_max']}"
    )
    table = Table(show_lines=False)
    for name, justify in (
        ("policy", "left"),
        ("avg spread\n(tokens)", "right"),
        ("avg I(k)\n(tokens)", "right"),
        ("barrier\nidle", "right"),
        ("throughput\n(tok/s)", "right"),
        ("TPOT P95\n(ms)", "right"),
        ("TTFT P50\n(ms)", "right"),
        ("TTFT P99\n(ms)", "right"),
        ("wait P50\n(ms)", "right"),
        ("decision\nP50/P99 ms", "right"),
    ):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for label, r in report.results.items():
        name = f"{label} [dim](offline bound)[/]" if r.offline_bound else label
        table.add_row(
            name,
            f"{r.avg_spread_tokens:,.0f}",
            f"{r.avg_imbalance_tokens:,.0f}",
            f"{100 * r.barrier_idle_fraction:.1f}%",
            f"{r.throughput_tokens_per_s:,.0f}",
            _f(r.tpot_p95_ms, ".1f"),
            _f(r.ttft_p50_ms, ",.0f"),
            _f(r.ttft_p99_ms, ",.0f"),
            _f(r.wait_p50_ms, ",.0f"),
            "–" if r.policy == "forced" else f"{_f(r.decision_ms_p50, '.3f')}/{_f(r.decision_ms_p99, '.3f')}",
        )
    console.print(table)
    console.print(balance_table(report))
    for line in comparison_lines(report):
        console.print(line)
    console.print(f"[dim]replayed in {report.wall_s:.1f} s; throughput and times come from the step model[/]")


def balance_table(report: ReplayReport) -> Table:
    """Balance in the field's units per lane (`shadow.engine.balance`): NVIDIA's balance ratio
    (time-weighted mean and p10) and speed-of-light throughput, BF-IO's idle rate, SGLang's max/min."""
    table = Table(title="balance in the field's units (per step, KV tokens; 1 − ratio = I(k)/(G·max L))")
    for name in ("policy", "balance ratio\nmean", "balance ratio\np10", "idle\nrate",
                 "SOL throughput\n(tok/s)", "max/min\np50", "max/min\np90", "max/min\np95"):
        table.add_column(name, justify="left" if name == "policy" else "right")
    for label, r in report.results.items():
        b = r.balance
        table.add_row(
            label,
            _f(b.get("balance_ratio_mean"), ".1%"),
            _f(b.get("balance_ratio_p10"), ".1%"),
            _f(b.get("idle_rate"), ".1%"),
            _f(b.get("sol_throughput_tokens_per_s"), ",.0f"),
            *(_ratio(b, f"max_min_ratio_p{q}") for q in (50, 90, 95)),
        )
    return table


def _ratio(b: BalanceFigures, key: str) -> str:
    """A max/min ratio; "∞" where a worker held nothing (no ratio before any step: "–")."""
    value = b.get(key)
    if value is None:
        return "∞" if b["zero_min_fraction"] else "–"
    return f"{value:.2f}"


def _cost_terms(c: dict[str, Any]) -> str:
    """The step model's per-sequence and prefill terms, and what BalanceRoute balances, where not 0."""
    seq, pre = c.get("step_c_s_per_seq", 0.0), c.get("step_p_s_per_prefill_token", 0.0)
    if not seq and not pre:
        return ""
    return f" + {seq:.3g}·n + {pre:.3g}·prefill tokens (per worker); BalanceRoute balances {c['route_cost']}"

"""Per-worker KV-load trajectories per policy (like the paper's Figure 3), drawn with matplotlib."""

from __future__ import annotations

from pathlib import Path

from shadow.replay.experiment import ReplayReport


def plot_trajectories(report: ReplayReport, path: str | Path) -> Path:
    """One panel per lane, one line per worker; writes `path` (PNG/SVG/PDF by suffix)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lanes = [r for r in report.results.values() if r.trajectory_t]
    if not lanes:
        raise ValueError("no trajectories were recorded (run with trajectory_points > 0)")
    cols = 2 if len(lanes) > 1 else 1
    rows = -(-len(lanes) // cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(7 * cols, 2.6 * rows), sharex=True, sharey=True, squeeze=False
    )
    for ax, r in zip(axes.flat, lanes, strict=False):
        loads = list(zip(*r.trajectory_loads, strict=True))
        for g, series in enumerate(loads):
            ax.plot(r.trajectory_t, [x / 1e3 for x in series], linewidth=0.7, label=f"w{g}")
        title = r.label + (" (offline bound)" if r.offline_bound else "")
        ax.set_title(f"{title}: avg spread {r.avg_spread_tokens / 1e3:.1f}k tokens", fontsize=9)
        ax.set_ylabel("KV load (k tokens)", fontsize=8)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(lanes) :]:
        ax.axis("off")
    for ax in axes[-1]:
        ax.set_xlabel("time (s, step model)", fontsize=8)
    w = report.workload
    tag = " — SYNTHETIC" if w["synthetic"] else ""
    fig.suptitle(f"{w['name']}{tag}: per-worker KV load, G={report.config['workers']}", fontsize=10)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out

"""The reproduction's figures: validation top-1 against the MLPerf clock or epochs, and each
strategy's step split into compute and waiting for communication."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from gradientflow_repro.reproduction.runs import run_target


def plot_top1(runs: dict[str, list[dict]], path: Path, x: str = "mlperf_s",
              targets: Optional[Sequence[float]] = None) -> None:
    """Validation top-1 against the MLPerf clock (``x="mlperf_s"``) or against epochs (``"epoch"``),
    with ``targets`` as lines (default: the target the runs stopped at, if any)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for index, (label, items) in enumerate(runs.items()):
        for repeat, run in enumerate(items):
            evals = [r for r in run["records"] if r["kind"] == "eval"]
            # the colour cycle has ten colours: past them, the line's style tells configurations apart
            ax.plot([r[x] for r in evals], [r["top1"] for r in evals], color=f"C{index % 10}",
                    linestyle=("-", "--", ":")[index // 10 % 3], alpha=1.0 if repeat == 0 else 0.35,
                    marker="o" if repeat == 0 else None, markersize=3,
                    label=label if repeat == 0 else None)
    if targets is None:
        target = run_target(next(iter(runs.values()))[0])
        targets = [target] if target else []
    for index, target in enumerate(targets):
        ax.axhline(target, color="grey", linestyle="--" if index == 0 else ":", linewidth=1,
                   label=f"target {target:g}%")
    ax.set_xlabel("wall-clock seconds (MLPerf clock)" if x == "mlperf_s" else "epochs")
    ax.set_ylabel("validation top-1 (%)")
    ax.set_title(f"Validation top-1 against {'time' if x == 'mlperf_s' else 'epochs'} (faint: other seeds)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_step_split(checks: dict[str, dict], path: Path, world: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(checks)
    comm = [checks[k]["sync_wait_s"] * 1e3 for k in labels]
    compute = [max(0.0, checks[k]["step_s"] * 1e3 - c) for k, c in zip(labels, comm)]
    fig, ax = plt.subplots(figsize=(7, 4))
    bars = ax.bar(labels, compute, label="compute (and hidden communication)")
    ax.bar(labels, comm, bottom=compute, label="waiting for communication")
    for label, bar in zip(labels, bars):
        if label == "ddp":  # DDP waits for its buckets inside backward: not separable from compute
            bar.set_hatch("//")
            ax.annotate("waits inside\nbackward", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=7)
    ax.set_ylabel("ms per step")
    ax.set_title(f"Time per step, world size {world}")
    ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

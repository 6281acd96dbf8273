"""The scaling model at cluster scale against the paper's two numbers: predicted speedup of every
strategy for 1 to 512 GPUs with the paper's setting (AlexNet, 56 Gbit/s; each parameter's source in
``perfmodel``), the full stack at 512 GPUs against its 410.2x and the naive baseline at 64 GPUs
against its 2.5x. Not fitted to either; where the model disagrees, the table says by how much and
what it would take to agree. ``write_scaling`` writes results/scaling.md and .png.
"""

from __future__ import annotations

from pathlib import Path

from gradientflow_repro import perfmodel as pm
from gradientflow_repro.comm import knobs

GPU_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def curves(profile: pm.ModelProfile, net: pm.Network) -> dict[str, list[float]]:
    """Speedup for each of ``GPU_COUNTS`` per strategy of the ladder (and the full stack on a
    hierarchical ring)."""
    hierarchical = knobs.resolve({**knobs.LADDER["gradientflow"], "algorithm": "hierarchical"})
    strategies = [*pm.LADDER, pm.Strategy.from_knobs("gradientflow, hierarchical", hierarchical)]
    return {s.name: [pm.speedup(profile, n, net, s) for n in GPU_COUNTS] for s in strategies}


def bandwidth_for(target: float, gpus: int, strategy: pm.Strategy) -> float:
    """The link bandwidth (Gbit/s) at which the model gives ``target`` speedup (bisection)."""
    profile, base = pm.paper_profile(), pm.paper_network()
    low, high = 1e6, 1e13
    for _ in range(100):
        mid = (low * high) ** 0.5
        net = pm.Network(mid, base.latency_s, base.ranks_per_node, base.intra_bandwidth_Bps, base.intra_latency_s)
        if pm.speedup(profile, gpus, net, strategy) < target:
            low = mid
        else:
            high = mid
    return high * 8 / 1e9


def _needed(gbps: float) -> str:
    return "no link bandwidth suffices" if gbps > 1e4 else f"links of {gbps:.0f} Gbit/s (model: {pm.PAPER_LINK_GBPS})"


def paper_check() -> tuple[list[str], dict[str, list[float]]]:
    """The comparison with the paper as Markdown lines, and the speedup table it is built on."""
    profile, net = pm.paper_profile(), pm.paper_network()
    table = curves(profile, net)
    full = next(s for s in pm.LADDER if s.name == "gradientflow")
    naive = pm.LADDER[0]
    at512 = table["gradientflow"][GPU_COUNTS.index(512)]
    at64 = table["allreduce"][GPU_COUNTS.index(64)]
    ratio, arithmetic = pm.paper_dense_ratio()
    lines = [
        "Parameters (each with its source in `gradientflow_repro/perfmodel.py`): " + arithmetic + ". "
        f"Assumed: {pm.ASSUMED_GPUS_PER_NODE} GPUs per node, {pm.ASSUMED_LATENCY_S * 1e6:.0f} us per message, "
        f"{pm.ASSUMED_INTRA_NODE_BPS / 1e9:.0f} GB/s inside a node, backward {pm.ASSUMED_BACKWARD_SHARE:.2f} "
        "of compute spread over the layers by size; weak scaling at 128 images per GPU.", "",
        "| check | paper | model | model / paper | the model agrees if ... |", "|---|---|---|---|---|",
        f"| full stack (`gradientflow`), 512 GPUs | {pm.PAPER_SPEEDUP}x | {at512:.1f}x "
        f"| {at512 / pm.PAPER_SPEEDUP:.2f} "
        f"| {_needed(bandwidth_for(pm.PAPER_SPEEDUP, 512, full))}, or the ring is hierarchical "
        f"({table['gradientflow, hierarchical'][-1]:.1f}x): the flat ring's 2(N-1) = 1022 messages per "
        f"allreduce at {pm.ASSUMED_LATENCY_S * 1e6:.0f} us each cost latency that no bandwidth removes |",
        f"| naive baseline (`allreduce`), 64 GPUs | {pm.PAPER_BASELINE_SPEEDUP}x | {at64:.1f}x | "
        f"{at64 / pm.PAPER_BASELINE_SPEEDUP:.2f} | links of {bandwidth_for(pm.PAPER_BASELINE_SPEEDUP, 64, naive):.1f} "
        "Gbit/s effective: the baseline systems did not use the link's 56 Gbit/s (TCP, parameter servers) |",
        "", "Predicted speedup against GPU count:", "",
        "| strategy | " + " | ".join(str(n) for n in GPU_COUNTS) + " |",
        "|---|" + "---|" * len(GPU_COUNTS)]
    for name, values in table.items():
        lines.append(f"| {name} | " + " | ".join(f"{v:.1f}" for v in values) + " |")
    return lines, table


def plot(table: dict[str, list[float]], path: Path) -> None:
    """Speedup against GPU count, with the paper's two points."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, values in table.items():
        ax.plot(GPU_COUNTS, values, marker="o", markersize=3, label=name)
    ax.plot(GPU_COUNTS, GPU_COUNTS, color="grey", linestyle=":", label="linear")
    ax.scatter([512], [pm.PAPER_SPEEDUP], color="black", marker="*", s=120, zorder=5, label="paper: 410.2x")
    ax.scatter([64], [pm.PAPER_BASELINE_SPEEDUP], color="red", marker="x", s=80, zorder=5, label="paper baseline: 2.5x")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("GPUs")
    ax.set_ylabel("speedup over one GPU")
    ax.set_title("Scaling model, AlexNet at 56 Gbit/s")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_scaling(out: Path, command: str = "python scripts/simulate_scaling.py") -> str:
    """``out``.md and ``out``.png; returns the Markdown."""
    lines, table = paper_check()
    out.parent.mkdir(parents=True, exist_ok=True)
    plot(table, out.with_suffix(".png"))
    text = "\n".join(["# Scaling model against the paper", "",
                      f"Command: `{command}`; a model, no machine involved.", "", *lines, "",
                      f"![speedup against GPUs]({out.with_suffix('.png').name})", ""])
    out.with_suffix(".md").write_text(text)
    return text

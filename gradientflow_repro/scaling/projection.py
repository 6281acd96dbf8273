"""The scaling model at cluster scale: any published setup projected, and the paper's two numbers.

A ``Setup`` names a model (ours, torchvision's or timm's), images per GPU, the single-GPU
throughput, and the cluster: link Gbit/s, GPUs per node, intra-node GB/s, per-message latency, and
the GPU's memory bandwidth (which prices CSC's and the fp16 wire's local work). Its defaults are the
paper's setting, each value with its source in ``perfmodel``. The model's inputs:
- backward readiness from the FLOPs of the real model at the given resolution
  (``profile.flop_profile``: torch.utils.flop_counter, scaled to the setup's step time). FLOPs, not
  a CPU timing: a CPU's per-layer ratios (GEMMs against convolutions) are not a GPU's, and FLOPs
  are the same on every device;
- small collectives at log2(N) latency steps, a node's uplink shared by its ranks when they all
  cross the network at once, and world sizes that are not a multiple of the node size
  (``perfmodel``: the same rules that the emulated-cluster benchmark checks);
- CSC's and the fp16 wire's local work priced as memory traffic over the GPU's bandwidth
  (``perfmodel.gpu_local_work``), with a sensitivity table.

``write_scaling`` writes results/scaling.md and .png: the speedup of every strategy against GPU
count, the checks against the paper (410.2x at 512 GPUs for the full stack, 2.5x at 64 for the
baseline) with the goals, and the sensitivity of the full stack at 512 GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional, Sequence

from gradientflow_repro.comm import knobs, registry
from gradientflow_repro.scaling import perfmodel as pm

GPU_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
UNEVEN_GPU_COUNTS = (12, 100, 500)  # not multiples of 8: a partly filled last node
SPEEDUP_GOAL = 435.0  # 85% efficiency at 512 GPUs: above the paper's 410.2x


def strategy_options() -> dict[str, dict]:
    """Strategies the projection knows, label -> ``comm`` options: every label of the registry (the
    ablation ladder, where ``gradientflow`` takes the two-level ring on multi-GPU nodes:
    ``comm.algorithm=auto``; the full stack forced onto the flat ring; ...) and every preset by its
    name. Labels that take their layout from a benchmark (``ranks_per_node``) are left out."""
    options = {label: registry.options(label) for label, (_, variant) in registry.variants().items()
               if not variant.layout_keys}
    for name in registry.names():
        options.setdefault(name, {"strategy": name})
    return options


def default_strategies() -> tuple[str, ...]:
    """What the projection projects unless told: the registry's ``PROJECTION`` list."""
    return registry.labels(registry.PROJECTION)


DEFAULT_STRATEGIES = default_strategies()  # as registered when this module loads


@dataclass(frozen=True)
class Setup:
    """A cluster and a model to project; the defaults are the paper's setting."""

    model: str = "alexnet_bn"
    image_size: int = 224
    images_per_gpu: int = pm.PAPER_PER_GPU_BATCH
    single_gpu_images_s: float = pm.PAPER_SINGLE_GPU_IMAGES_S
    link_gbps: float = pm.PAPER_LINK_GBPS
    gpus_per_node: int = pm.ASSUMED_GPUS_PER_NODE
    intra_node_GBps: float = pm.ASSUMED_INTRA_NODE_BPS / 1e9
    latency_us: float = pm.ASSUMED_LATENCY_S * 1e6
    gpu_memory_GBps: float = pm.ASSUMED_GPU_MEMORY_BPS / 1e9
    num_classes: int = 1000
    strategies: tuple[str, ...] = field(default_factory=default_strategies)

    @property
    def is_paper(self) -> bool:
        """The paper's cluster and model, with the strategies its checks compare."""
        return (replace(self, strategies=default_strategies()) == Setup()
                and {"gradientflow", "allreduce", registry.LAZY_FP16} <= set(self.strategies))

    def profile(self) -> pm.ModelProfile:
        from gradientflow_repro.scaling.profile import flop_profile

        profile = flop_profile(self.model, self.image_size, self.images_per_gpu, self.single_gpu_images_s,
                               self.num_classes)
        return pm.gpu_local_work(profile, self.gpu_memory_GBps * 1e9) if self.gpu_memory_GBps else profile

    def network(self) -> pm.Network:
        return pm.Network(self.link_gbps * 1e9 / 8, self.latency_us * 1e-6, self.gpus_per_node,
                          self.intra_node_GBps * 1e9, self.latency_us * 1e-6, nccl=True)

    def strategy(self, label: str) -> pm.Strategy:
        options, label = strategy_options(), registry.canonical(label)  # an old label: its current one
        if label not in options:
            raise ValueError(f"unknown strategy {label!r}: allowed are {', '.join(options)}")
        return pm.Strategy.from_knobs(label, knobs.resolve(options[label]))


def curves(setup: Setup, counts: Sequence[int] = GPU_COUNTS,
           profile: Optional[pm.ModelProfile] = None) -> dict[str, list[float]]:
    """Speedup for each of ``counts`` per strategy of the setup."""
    profile, net = profile or setup.profile(), setup.network()
    return {label: [pm.speedup(profile, n, net, setup.strategy(label)) for n in counts]
            for label in setup.strategies}


def bandwidth_for(target: float, gpus: int, strategy: pm.Strategy, setup: Setup,
                  profile: pm.ModelProfile) -> float:
    """The link bandwidth (Gbit/s) at which the model gives ``target`` speedup (bisection)."""
    base = setup.network()
    low, high = 1e6, 1e13
    for _ in range(100):
        mid = (low * high) ** 0.5
        if pm.speedup(profile, gpus, replace(base, bandwidth_Bps=mid), strategy) < target:
            low = mid
        else:
            high = mid
    return high * 8 / 1e9


def latency_for(target: float, gpus: int, strategy: pm.Strategy, setup: Setup, profile: pm.ModelProfile) -> float:
    """The per-message latency (seconds) at which the model gives ``target`` speedup (bisection)."""
    base = setup.network()
    low, high = 1e-7, 10.0
    for _ in range(100):
        mid = (low * high) ** 0.5
        if pm.speedup(profile, gpus, replace(base, latency_s=mid, intra_latency_s=mid), strategy) > target:
            low = mid
        else:
            high = mid
    return low


def local_work_s(profile: pm.ModelProfile, strategy: pm.Strategy) -> float:
    """Seconds of CSC's and the fp16 wire's local work per step (sum over the messages)."""
    return sum(m.local_work_s for m in pm.messages(profile, strategy))


def _local_work_rows(setup: Setup, profile: pm.ModelProfile, strategy: pm.Strategy) -> list[str]:
    """Speedup at 512 GPUs against the local work per step, 0 to 5 ms (the GPU's memory rate scaled):
    on the communication path, overlapping backward as the model has it, and, as the worst case,
    added to the step (the GPU's memory traffic for it slows backward by as much)."""
    unit = local_work_s(pm.gpu_local_work(profile, 1.0), strategy)  # seconds at 1 byte/s
    net, rows = setup.network(), []
    single = pm.predict_step(profile, 1, net, strategy).step_s
    for target_ms in (0.0, 1.0, 2.0, 3.0, 5.0):
        priced = (replace(profile, sparsify_s_per_element=0.0, wire_cast_s_per_element=0.0) if target_ms == 0
                  else pm.gpu_local_work(profile, unit / (target_ms * 1e-3)))
        overlapped = pm.speedup(priced, 512, net, strategy)
        serial = 512 * single / (pm.predict_step(priced, 512, net, strategy).step_s + target_ms * 1e-3)
        rows.append(f"| GPU local work {target_ms:.0f} ms per step (overlapping backward; added to the step) "
                    f"| {overlapped:.1f}x; {serial:.1f}x | {_versus(overlapped)}; {_versus(serial)} |")
    return rows


def _versus(value: float) -> str:
    return "above" if value > pm.PAPER_SPEEDUP else "BELOW"


def sensitivity(setup: Setup, profile: pm.ModelProfile, label: str = "gradientflow") -> list[str]:
    """The full stack's speedup at 512 GPUs as one assumption at a time moves (the others at the
    setup's values), then latency and node size together."""
    strategy = setup.strategy(label)

    def at(**changes: float | int) -> float:
        return pm.speedup(profile, 512, replace(setup, **changes).network(), strategy)

    lines = [f"| assumption (others as above) | `{label}` at 512 GPUs | vs the paper's {pm.PAPER_SPEEDUP}x |",
             "|---|---|---|"]
    for latency in (2, 5, 10, 20):
        value = at(latency_us=latency)
        lines.append(f"| {latency} us per message | {value:.1f}x | {_versus(value)} |")
    for per_node in (4, 8):
        value = at(gpus_per_node=per_node)
        lines.append(f"| {per_node} GPUs per node | {value:.1f}x | {_versus(value)} |")
    lines += _local_work_rows(setup, profile, strategy)
    grid = ["", f"Latency and node size together (`{label}`, speedup at 512 GPUs):", "",
            "| GPUs per node | " + " | ".join(f"{lat} us" for lat in (2, 5, 10, 20)) + " |", "|---|---|---|---|---|"]
    for per_node in (4, 8):
        grid.append(f"| {per_node} | " + " | ".join(f"{at(latency_us=lat, gpus_per_node=per_node):.1f}x"
                                                   for lat in (2, 5, 10, 20)) + " |")
    return lines + grid


def breakdown(setup: Setup, profile: pm.ModelProfile, label: str, gpus: int = 512) -> list[str]:
    """Where a step's time goes for ``label`` at ``gpus`` GPUs: each message's readiness, cost and
    end, against the end of backward."""
    strategy, net = setup.strategy(label), setup.network()
    lines = ["| message | ready (ms) | payload (MB) | small allreduce (KB) | local work (ms) | busy (ms) | ends (ms) |",
             "|---|---|---|---|---|---|---|"]
    clock = 0.0 if strategy.overlap else profile.backward_s
    for index, message in enumerate(pm.messages(profile, strategy)):
        cost = pm.message_s(message, gpus, net, strategy)
        clock = max(clock, message.ready_s if strategy.overlap else profile.backward_s) + cost
        lines.append(f"| {index} | {message.ready_s * 1e3:.1f} | {message.payload_bytes / 1e6:.2f} "
                     f"| {message.small_bytes / 1e3:.1f} | {message.local_work_s * 1e3:.2f} | {cost * 1e3:.2f} "
                     f"| {clock * 1e3:.1f} |")
    step = pm.predict_step(profile, gpus, net, strategy)
    lines += ["", f"Backward ends at {profile.backward_s * 1e3:.1f} ms; communication exposed after it "
              f"{step.exposed_comm_s * 1e3:.2f} ms; step {step.step_s * 1e3:.1f} ms against "
              f"{step.compute_s * 1e3:.1f} ms of compute."]
    return lines


def _readiness_note(profile: pm.ModelProfile) -> str:
    """How the FLOP profile differs from spreading backward by parameter count."""
    total = profile.elements
    largest = max(profile.tensors, key=lambda t: t.elements)
    done = 0
    for tensor in profile.tensors:
        done += tensor.elements
        if tensor is largest:
            break
    return (f"The largest gradient ({largest.elements / 1e6:.1f}M elements) is complete "
            f"{100 * largest.ready_s / profile.backward_s:.0f}% into backward by FLOPs; spread by parameter "
            f"count it would be {100 * done / total:.0f}%.")


def paper_check(setup: Setup = Setup()) -> tuple[list[str], dict[str, list[float]]]:
    """The projection as Markdown lines (checks against the paper when the setup is the paper's),
    and the speedup table it is built on."""
    profile = setup.profile()
    table = curves(setup, GPU_COUNTS, profile)
    step = setup.images_per_gpu / setup.single_gpu_images_s
    gflops = _gflops(setup)
    lines = [
        f"Setup: model `{setup.model}` at {setup.image_size} pixels, {setup.images_per_gpu} images per GPU, "
        f"one GPU at {setup.single_gpu_images_s:,.0f} images/s (a step of {step * 1e3:.1f} ms: forward "
        f"{profile.forward_s * 1e3:.1f}, backward {profile.backward_s * 1e3:.1f}, split by FLOPs: {gflops}), "
        f"{profile.elements / 1e6:.1f}M gradients; links of {setup.link_gbps:g} Gbit/s per node, "
        f"{setup.gpus_per_node} GPUs per node sharing it, {setup.intra_node_GBps:g} GB/s inside a node, "
        f"{setup.latency_us:g} us per message; CSC's and the fp16 wire's local work at "
        f"{setup.gpu_memory_GBps:g} GB/s of GPU memory traffic ({pm.CSC_BYTES_PER_ELEMENT} and "
        f"{pm.FP16_WIRE_BYTES_PER_ELEMENT} bytes per element). Weak scaling.", "",
        "Sources: " + (pm.paper_dense_ratio()[1] + ". " if setup.is_paper else "") +
        "Backward readiness: FLOPs of the real model counted by `torch.utils.flop_counter` "
        "(`gradientflow_repro/scaling/profile.py`). " + _readiness_note(profile) + " "
        "Assumed where the paper is silent (`gradientflow_repro/scaling/perfmodel.py`): GPUs per node, latency, "
        "intra-node rate, GPU memory rate; their effect is in the sensitivity table below.", ""]
    if setup.is_paper:
        lines += _paper_rows(setup, profile, table)
    lines += ["", "Predicted speedup against GPU count:", "",
              "| strategy | " + " | ".join(str(n) for n in GPU_COUNTS) + " |",
              "|---|" + "---|" * len(GPU_COUNTS)]
    for name, values in table.items():
        lines.append(f"| {name} | " + " | ".join(f"{v:.1f}" for v in values) + " |")
    uneven = curves(setup, UNEVEN_GPU_COUNTS, profile)
    lines += ["", f"World sizes that are not a multiple of {setup.gpus_per_node} (the last node partly filled):", "",
              "| strategy | " + " | ".join(str(n) for n in UNEVEN_GPU_COUNTS) + " |",
              "|---|" + "---|" * len(UNEVEN_GPU_COUNTS)]
    lines += [f"| {name} | " + " | ".join(f"{v:.1f}" for v in values) + " |" for name, values in uneven.items()]
    if "gradientflow" in setup.strategies:
        lines += ["", "## Sensitivity", "", *sensitivity(setup, profile), "",
                  "## Where the full stack's step goes at 512 GPUs", "", *breakdown(setup, profile, "gradientflow")]
    return lines, table


def _gflops(setup: Setup) -> str:
    from gradientflow_repro.scaling.profile import flops_per_image

    counted = flops_per_image(setup.model, setup.image_size, setup.num_classes)
    return (f"{counted.forward_flops / 1e9:.2f} GFLOPs forward and {counted.backward_flops / 1e9:.2f} backward "
            "per image")


def _paper_rows(setup: Setup, profile: pm.ModelProfile, table: dict[str, list[float]]) -> list[str]:
    naive = setup.strategy("allreduce")
    at512 = table["gradientflow"][GPU_COUNTS.index(512)]
    at64 = table["allreduce"][GPU_COUNTS.index(64)]
    lazy = table.get(registry.LAZY_FP16)
    above = ([n for n, g, d in zip(GPU_COUNTS, table["gradientflow"], lazy) if n >= 16 and g <= d]
             if lazy else [])
    rate = bandwidth_for(pm.PAPER_BASELINE_SPEEDUP, 64, naive, setup, profile)
    latency = latency_for(pm.PAPER_BASELINE_SPEEDUP, 64, naive, setup, profile)
    return [
        "| check | paper | model | model / paper | goal |", "|---|---|---|---|---|",
        f"| full stack (`gradientflow`, two-level ring), 512 GPUs | {pm.PAPER_SPEEDUP}x | {at512:.1f}x "
        f"| {at512 / pm.PAPER_SPEEDUP:.2f} | >= {SPEEDUP_GOAL:.0f}x: {'met' if at512 >= SPEEDUP_GOAL else 'NOT met'} |",
        f"| `gradientflow` above dense lazy (`{registry.LAZY_FP16}`) from 16 GPUs | - | "
        f"{'yes at every count' if lazy and not above else 'not at ' + ', '.join(map(str, above))} | - | "
        f"{'met' if lazy and not above else 'NOT met'} |",
        f"| naive baseline (`allreduce`), 64 GPUs | {pm.PAPER_BASELINE_SPEEDUP}x | {at64:.1f}x | "
        f"{at64 / pm.PAPER_BASELINE_SPEEDUP:.2f} | reproduced with links of {rate:.1f} Gbit/s effective, or "
        f"{latency * 1e3:.2f} ms per message at 56 Gbit/s: the baseline systems used neither the link's rate "
        "nor its latency (TCP, parameter servers) |",
        f"| full stack on the flat ring, 512 GPUs | - | {table.get(registry.FLAT, [0])[-1]:.1f}x | - | "
        "the flat ring's 2(N-1) = 1022 latencies per pool part are why the two-level ring is the default |"]


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
    ax.set_title("Scaling model")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_scaling(out: Path, setup: Setup = Setup(), command: str = "python scripts/simulate_scaling.py") -> str:
    """``out``.md and ``out``.png; returns the Markdown."""
    lines, table = paper_check(setup)
    out.parent.mkdir(parents=True, exist_ok=True)
    plot(table, out.with_suffix(".png"))
    from gradientflow_repro.provenance import environment_facts

    commit = environment_facts().get("git_commit", "unknown")
    text = "\n".join(["# Scaling model" + (" against the paper" if setup.is_paper else ""), "",
                      f"Command: `{command}`; commit {commit}; a model: no machine's speed enters it. "
                      "The model's rules are checked against measurement on an emulated two-level cluster "
                      "(`results/cluster_comm.md`) and in the training ladder (`results/REPORT.md`).", "",
                      *lines, "", f"![speedup against GPUs]({out.with_suffix('.png').name})", ""])
    out.with_suffix(".md").write_text(text)
    return text

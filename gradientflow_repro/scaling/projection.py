"""The scaling model at cluster scale: any published setup projected, and the paper's two numbers.

A ``Setup`` names a model (ours, torchvision's or timm's), images per GPU, the single-GPU
throughput, and the cluster: link Gbit/s, GPUs per node, intra-node GB/s, per-message latency, the
GPU's memory bandwidth (which prices CSC's and the fp16 wire's local work), the backend (NCCL or
gloo), and what a fitted model adds (``perfmodel``: the links' efficiency, backward's slowdown under
overlapped communication, a per-step overhead); optionally one pool part / bucket size and one CSC
density for every strategy. Its defaults are the paper's setting, each value with its source in
``perfmodel``. The model's inputs:
- backward readiness from the FLOPs of the real model at the given resolution
  (``profile.flop_profile``: torch.utils.flop_counter, scaled to the setup's step time; shipped as
  data for the usual models, so that projecting them needs no torch). FLOPs, not a CPU timing: a
  CPU's per-layer ratios (GEMMs against convolutions) are not a GPU's, and FLOPs are the same on
  every device;
- small collectives at log2(N) latency steps, a node's uplink shared by its ranks when they all
  cross the network at once, and world sizes that are not a multiple of the node size
  (``perfmodel``: the same rules that the emulated-cluster benchmark checks);
- CSC's and the fp16 wire's local work priced as memory traffic over the GPU's bandwidth
  (``perfmodel.gpu_local_work``), with a sensitivity table.

``projection_data`` measures a projection into data (``write_scaling`` writes it as JSON beside its
figure, and ``render/scaling.py`` words it as Markdown): the speedup of every strategy for any GPU
counts, world sizes whose last node is partly filled, the sensitivity of the full stack at the
largest count and where its step goes; and, only for the paper's own setup, the checks against the
paper (410.2x at 512 GPUs for the full stack, 2.5x at 64 for the baseline) with each goal's verdict
as a value. There every goal is judged on the calibrated model (``calibrated``: the terms fitted on
published results by ``scripts/model_check.py``, with its band), never on the uncalibrated rules,
which over-predict every published result and are shown as what they are: a ceiling set by
communication alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional, Sequence

from gradientflow_repro import variants
from gradientflow_repro.reproduction.lineup import PEER_LABELS
from gradientflow_repro.scaling import perfmodel as pm
from gradientflow_repro.scaling.strategy import (  # noqa: F401 - the labels it projects, read there
    default_strategies,
    parse_strategies,
    priced,
    strategy_options,
)

GPU_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
UNEVEN_GPU_COUNTS = (12, 100, 500)  # not multiples of 8: a partly filled last node (``uneven_counts(8, 512)``)
UNEVEN_FULL_NODES = (1, 12, 62, 250)  # full nodes before the half-filled last one (``uneven_counts``)


def uneven_counts(gpus_per_node: int, largest: int) -> tuple[int, ...]:
    """World sizes that are not a multiple of ``gpus_per_node``, up to ``largest``: m full nodes and a
    last one half filled (m in ``UNEVEN_FULL_NODES``; 12, 100, 500 for 8 GPUs per node up to 512).
    Empty for one GPU per node, where every size is a multiple."""
    if gpus_per_node < 2:
        return ()
    return tuple(n for n in (m * gpus_per_node + gpus_per_node // 2 for m in UNEVEN_FULL_NODES) if n <= largest)


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
    nccl: bool = True  # an NCCL network (GPUs); False: gloo, where our algorithms carry every non-builtin sum
    nccl_algo: Optional[str] = None  # NCCL_ALGO in the job's environment (``Network.nccl_algo``); None: the tuner
    bucket_mb: Optional[float] = None  # every fused strategy's pool part (DDP's bucket); None: each preset's
    density: Optional[float] = None  # every sparse strategy's density; None: each preset's
    link_efficiency: float = 1.0  # ``Network.link_efficiency``
    overlap_slowdown: float = 0.0  # ``Network.overlap_slowdown``
    local_work_slowdown: Optional[float] = None  # ``Network.local_work_slowdown`` (None: as overlap_slowdown)
    step_overhead_s: float = 0.0  # ``ModelProfile.step_overhead_s``

    @property
    def is_paper(self) -> bool:
        """The paper's cluster and model, with the strategies its checks compare."""
        return (replace(self, strategies=default_strategies()) == Setup()
                and {"gradientflow", "allreduce", variants.LAZY_FP16} <= set(self.strategies))

    def profile(self) -> pm.ModelProfile:
        from gradientflow_repro.scaling.profile import flop_profile

        profile = flop_profile(self.model, self.image_size, self.images_per_gpu, self.single_gpu_images_s,
                               self.num_classes)
        profile = pm.gpu_local_work(profile, self.gpu_memory_GBps * 1e9) if self.gpu_memory_GBps else profile
        return replace(profile, step_overhead_s=self.step_overhead_s)

    def network(self) -> pm.Network:
        return pm.Network(self.link_gbps * 1e9 / 8, self.latency_us * 1e-6, self.gpus_per_node,
                          self.intra_node_GBps * 1e9, self.latency_us * 1e-6, nccl=self.nccl, nccl_algo=self.nccl_algo,
                          link_efficiency=self.link_efficiency, overlap_slowdown=self.overlap_slowdown,
                          local_work_slowdown=self.local_work_slowdown)

    def strategy(self, label: str) -> pm.Strategy:
        """``label``'s strategy as the model prices it, with the setup's pool part size and density
        (where set) in place of its preset's: the part size on every fused strategy (DDP's bucket
        for ``ddp``), the density on every sparse one; per-tensor and dense strategies ignore them."""
        return priced(label, self.bucket_mb, self.density)

    def extras(self) -> list[str]:
        """What the setup sets beyond the cluster's rates, in words (nothing for the defaults)."""
        said = [] if self.nccl else ["gloo instead of NCCL (our algorithms carry every sum but the builtin's)"]
        if self.bucket_mb is not None:
            said.append(f"pool parts (DDP: buckets) of {self.bucket_mb:g} MB for every fused strategy")
        if self.density is not None:
            said.append(f"density {self.density:g} for every sparse strategy")
        if self.link_efficiency != 1.0:
            said.append(f"links carrying {self.link_efficiency:g} of their rate")
        if self.overlap_slowdown:
            said.append(f"backward slowed by {self.overlap_slowdown:g} s per second of communication it overlaps")
        if self.local_work_slowdown is not None:
            said.append(f"backward slowed by {self.local_work_slowdown:g} s per second of local work it overlaps")
        if self.step_overhead_s:
            said.append(f"{self.step_overhead_s * 1e3:g} ms of framework overhead per step on more than one GPU")
        return said


def calibrated(setup: Setup, path: Optional[Path] = None) -> Optional[tuple[Setup, dict]]:
    """``setup`` with the terms that ``scripts/model_check.py`` fitted on published results (written to
    ``results/model_check.json``): the link efficiency of the paper's fabric (56 Gbit/s FDR; its
    prior where no fitted row measures it) and the overlap slowdown, without a framework's overhead
    (the band spans it); and the file's data (its ``paper_band``). None where it has not been written.
    Torch-free: a JSON file."""
    from gradientflow_repro.scaling import calibration

    data = calibration.committed(path)
    if data is None:
        return None
    params = calibration.Parameters(**data["parameters"])
    return replace(setup, link_efficiency=params.link("ib56"), overlap_slowdown=params.overlap_slowdown), data


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


def _local_work_rows(setup: Setup, profile: pm.ModelProfile, strategy: pm.Strategy, gpus: int) -> list[dict]:
    """Speedup at ``gpus`` GPUs against the local work per step, 0 to 5 ms (the GPU's memory rate
    scaled): on the communication path, hidden by backward as the setup has it, and, as the worst
    case, not hidden at all (``Network.local_work_slowdown`` 1: the GPU's memory traffic for it
    slows backward by as much)."""
    unit = local_work_s(pm.gpu_local_work(profile, 1.0), strategy)  # seconds at 1 byte/s
    net, rows = setup.network(), []
    unhidden = replace(net, local_work_slowdown=1.0)
    for target_ms in (0.0, 1.0, 2.0, 3.0, 5.0):
        priced = (replace(profile, sparsify_s_per_element=0.0, wire_cast_s_per_element=0.0) if target_ms == 0
                  else pm.gpu_local_work(profile, unit / (target_ms * 1e-3)))
        rows.append({"local_work_ms": target_ms, "hidden": pm.speedup(priced, gpus, net, strategy),
                     "unhidden": pm.speedup(priced, gpus, unhidden, strategy)})
    return rows


LATENCIES_US = (2, 5, 10, 20)  # the sensitivity's latencies per message


def sensitivity(setup: Setup, profile: pm.ModelProfile, label: str = "gradientflow", gpus: int = 512,
                versus: Optional[bool] = None) -> dict[str, Any]:
    """The full stack's speedup at ``gpus`` GPUs as one assumption at a time moves (the others at the
    setup's values), then latency and node size together, and against the local work per step;
    against the paper's 410.2x only for the paper's own setup (``versus``; None: whether ``setup`` is
    the paper's), each row's ``above_paper`` a verdict."""
    versus = setup.is_paper if versus is None else versus
    strategy, versus = setup.strategy(label), versus and gpus == pm.PAPER_GPUS

    def at(**changes: float | int) -> float:
        return pm.speedup(profile, gpus, replace(setup, **changes).network(), strategy)

    node_sizes = sorted({4, 8, setup.gpus_per_node})
    rows = ([{"what": f"{latency} us per message", "speedup": at(latency_us=latency)} for latency in LATENCIES_US]
            + [{"what": f"{per_node} GPUs per node", "speedup": at(gpus_per_node=per_node)} for per_node in node_sizes])
    local = _local_work_rows(setup, profile, strategy, gpus)
    if versus:
        for row in rows:
            row["above_paper"] = row["speedup"] > pm.PAPER_SPEEDUP
        for row in local:
            row["hidden_above_paper"] = row["hidden"] > pm.PAPER_SPEEDUP
            row["unhidden_above_paper"] = row["unhidden"] > pm.PAPER_SPEEDUP
    return {"label": label, "gpus": gpus, "versus_paper": versus, "paper_speedup": pm.PAPER_SPEEDUP,
            "rows": rows, "local_work": local, "latencies_us": list(LATENCIES_US), "node_sizes": node_sizes,
            "grid": [[at(latency_us=lat, gpus_per_node=per_node) for lat in LATENCIES_US] for per_node in node_sizes]}


def breakdown(setup: Setup, profile: pm.ModelProfile, label: str, gpus: int = 512) -> dict[str, Any]:
    """Where a step's time goes for ``label`` at ``gpus`` GPUs: each message's readiness, cost and
    end, against the end of backward (stretched by the communication it overlaps, where the setup's
    ``overlap_slowdown`` says so; the links at the setup's efficiency). Seconds and bytes."""
    strategy, net = setup.strategy(label), setup.network()
    step = pm.predict_step(profile, gpus, net, strategy)
    net = pm.effective_network(net)
    profile = pm.stretched_backward(profile, gpus, net, strategy)
    clock, rows = (0.0 if strategy.overlap else profile.backward_s), []
    for message in pm.messages(profile, strategy):
        cost = pm.message_s(message, gpus, net, strategy)
        clock = max(clock, message.ready_s if strategy.overlap else profile.backward_s) + cost
        rows.append({"ready_s": message.ready_s, "payload_bytes": message.payload_bytes,
                     "small_bytes": message.small_bytes, "local_work_s": message.local_work_s, "busy_s": cost,
                     "ends_s": clock})
    return {"messages": rows, "backward_s": profile.backward_s, "exposed_comm_s": step.exposed_comm_s,
            "step_s": step.step_s, "compute_s": step.compute_s}


def _readiness(profile: pm.ModelProfile) -> dict[str, float]:
    """How the FLOP profile differs from spreading backward by parameter count: when the largest
    gradient is ready, as a share of backward, each way."""
    total = profile.elements
    largest = max(profile.tensors, key=lambda t: t.elements)
    done = 0
    for tensor in profile.tensors:
        done += tensor.elements
        if tensor is largest:
            break
    return {"largest_elements": largest.elements, "ready_share_by_flops": largest.ready_s / profile.backward_s,
            "ready_share_by_count": done / total}


def _paper_checks(setup: Setup, profile: pm.ModelProfile, table: dict[str, list[float]],
                  fitted: Optional[tuple[Setup, dict]]) -> dict[str, Any]:
    """The checks against the paper: each goal judged on the calibrated model (``fitted``: the
    calibrated setup and ``results/model_check.json``'s band), the uncalibrated figure beside it as
    the ceiling it is; without a calibration, the ceilings alone and no goal judged (``goals`` None)."""
    at512, at64 = table["gradientflow"][GPU_COUNTS.index(512)], table["allreduce"][GPU_COUNTS.index(64)]
    checks: dict[str, Any] = {"ceiling_full_stack_512": at512, "ceiling_baseline_64": at64, "goals": None,
                              "paper_speedup": pm.PAPER_SPEEDUP, "paper_baseline_speedup": pm.PAPER_BASELINE_SPEEDUP,
                              "lazy": variants.LAZY_FP16, "flat": variants.FLAT}
    if fitted is None:
        return checks
    model_setup, data = fitted
    band = {label: {k: v for k, v in entry.items() if k != "grid"} for label, entry in data["paper_band"].items()}
    labels = ("gradientflow", variants.LAZY_FP16, "allreduce", variants.FLAT)
    central = curves(replace(model_setup, strategies=tuple(label for label in labels if label in table)),
                     GPU_COUNTS, profile)
    lazy = central.get(variants.LAZY_FP16)
    below = ([n for n, g, d in zip(GPU_COUNTS, central["gradientflow"], lazy) if n >= 16 and g <= d]
             if lazy else [])
    naive = model_setup.strategy("allreduce")
    effective = replace(model_setup, link_efficiency=1.0)  # the rate a ring reaches, not the nominal one

    def contains(label: str, paper: float) -> bool:
        return band[label]["low"] <= paper <= band[label]["high"]

    peers = [label for label in ("gradientflow", "ddp", *PEER_LABELS) if label in band]
    ceilings = curves(replace(setup, strategies=tuple(peers)), (512,), profile) if len(peers) > 1 else {}
    checks.update({
        "link_efficiency": model_setup.link_efficiency, "overlap_slowdown": model_setup.overlap_slowdown,
        "test_rms_points": data["test_rms_points"], "band": band, "lazy_counts_below": below,
        "lazy_projected": lazy is not None,
        "goals": {"full_stack_band_contains_paper": contains("gradientflow", pm.PAPER_SPEEDUP),
                  "full_stack_above_dense_lazy_from_16": lazy is not None and not below,
                  "baseline_band_contains_paper": contains("allreduce", pm.PAPER_BASELINE_SPEEDUP)},
        "baseline_link_gbps_for_paper": bandwidth_for(pm.PAPER_BASELINE_SPEEDUP, 64, naive, effective, profile),
        "baseline_latency_s_for_paper": latency_for(pm.PAPER_BASELINE_SPEEDUP, 64, naive, effective, profile),
        "ceiling_flat_512": table.get(variants.FLAT, [0.0])[-1],
        "calibrated_flat_512": central.get(variants.FLAT, [0.0])[-1],
        "peers": [{"label": label, "ceiling": ceilings[label][0], **band[label]} for label in peers]
        if len(peers) > 1 else []})
    return checks


def _setup_facts(setup: Setup, profile: pm.ModelProfile) -> dict[str, Any]:
    """What the projection's text says of its setup, and where its inputs come from."""
    from gradientflow_repro.scaling.profile import flops_per_image, shipped_flops, shipped_path

    counted = flops_per_image(setup.model, setup.image_size, setup.num_classes)
    shipped = None
    if shipped_flops(setup.model, setup.image_size, setup.num_classes) is not None:
        path = shipped_path(setup.model, setup.image_size)
        shipped = path.relative_to(path.parents[3]).as_posix()
    return {"model": setup.model, "image_size": setup.image_size, "images_per_gpu": setup.images_per_gpu,
            "single_gpu_images_s": setup.single_gpu_images_s,
            "step_s": setup.images_per_gpu / setup.single_gpu_images_s, "forward_s": profile.forward_s,
            "backward_s": profile.backward_s, "forward_gflops": counted.forward_flops / 1e9,
            "backward_gflops": counted.backward_flops / 1e9, "elements": profile.elements,
            "link_gbps": setup.link_gbps, "gpus_per_node": setup.gpus_per_node,
            "intra_node_GBps": setup.intra_node_GBps, "latency_us": setup.latency_us,
            "gpu_memory_GBps": setup.gpu_memory_GBps,
            "bytes_per_element": {"csc": pm.CSC_BYTES_PER_ELEMENT, "fp16_wire": pm.FP16_WIRE_BYTES_PER_ELEMENT,
                                  "low_rank": pm.LOW_RANK_BYTES_PER_ELEMENT},
            "extras": setup.extras(), "shipped_profile": shipped, "readiness": _readiness(profile),
            "paper_dense_ratio": pm.paper_dense_ratio()[1] if setup.is_paper else None}


def projection_data(setup: Setup = Setup(), counts: Sequence[int] = GPU_COUNTS,
                    calibrate: bool = True) -> dict[str, Any]:
    """The projection for ``counts`` GPUs as data (checks against the paper when the setup is the
    paper's, at the paper's counts whatever ``counts`` is; ``calibrate``: judge them on the committed
    calibration, ``calibrated``, where one is written). ``speedup`` is the table that its figure and
    any claim drawn from it use: the calibrated model's where the setup is the paper's and it is
    calibrated, else the setup's own (``ceiling``)."""
    counts = tuple(counts)
    profile = setup.profile()
    table = curves(setup, counts, profile)
    fitted = calibrated(setup) if setup.is_paper and calibrate else None
    model_setup = fitted[0] if fitted else setup  # what the goals, the sensitivity and the breakdown use
    data: dict[str, Any] = {"paper": setup.is_paper, "setup": _setup_facts(setup, profile), "counts": list(counts),
                            "ceiling": table, "calibrated": None, "checks": None, "uneven": None,
                            "sensitivity": None, "breakdown": None}
    if setup.is_paper:
        paper_table = table if counts == GPU_COUNTS else curves(setup, GPU_COUNTS, profile)
        data["checks"] = _paper_checks(setup, profile, paper_table, fitted)
        if fitted:
            data["calibrated"] = curves(model_setup, counts, profile)
    uneven_sizes = uneven_counts(setup.gpus_per_node, max(counts))
    if uneven_sizes:
        data["uneven"] = {"gpus_per_node": setup.gpus_per_node, "counts": list(uneven_sizes),
                          "table": curves(model_setup, uneven_sizes, profile)}
    gpus = pm.PAPER_GPUS if setup.is_paper else max(counts)
    if "gradientflow" in setup.strategies and gpus > 1:
        data["sensitivity"] = sensitivity(model_setup, profile, gpus=gpus, versus=setup.is_paper)
        data["breakdown"] = {"gpus": gpus, **breakdown(model_setup, profile, "gradientflow", gpus)}
    # never the ceiling: what the figure plots and the reports quote is the calibrated model where there is one
    data["speedup"] = data["calibrated"] or table
    return data


def paper_check(setup: Setup = Setup(), counts: Sequence[int] = GPU_COUNTS,
                calibrate: bool = True) -> tuple[list[str], dict[str, list[float]]]:
    """The projection (``projection_data``) as Markdown lines (``render/scaling.py``), and the
    speedup table over ``counts`` that its figure and any claim drawn from it use."""
    from gradientflow_repro.render import scaling as render_scaling

    data = projection_data(setup, counts, calibrate)
    return render_scaling.projection_lines(data), data["speedup"]


def plot(table: dict[str, list[float]], path: Path, counts: Sequence[int] = GPU_COUNTS, paper: bool = True) -> None:
    """Speedup against GPU count (``counts``, the table's), with the paper's two points if ``paper``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, values in table.items():
        ax.plot(counts, values, marker="o", markersize=3, label=name)
    ax.plot(counts, counts, color="grey", linestyle=":", label="linear")
    if paper:
        ax.scatter([pm.PAPER_GPUS], [pm.PAPER_SPEEDUP], color="black", marker="*", s=120, zorder=5,
                   label=f"paper: {pm.PAPER_SPEEDUP}x")
        ax.scatter([pm.PAPER_BASELINE_GPUS], [pm.PAPER_BASELINE_SPEEDUP], color="red", marker="x", s=80, zorder=5,
                   label=f"paper baseline: {pm.PAPER_BASELINE_SPEEDUP}x")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("GPUs")
    ax.set_ylabel("speedup over one GPU")
    ax.set_title("Scaling model")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_scaling(out: Path, setup: Setup = Setup(), command: str = "python scripts/simulate_scaling.py",
                  counts: Sequence[int] = GPU_COUNTS, band: Optional[dict] = None, terms: Sequence[dict] = (),
                  calibrate: bool = True) -> str:
    """``out``.json (the projection's data, ``projection_data``, with the paper's calibrated ``band``
    and the calibration ``terms`` the setup took, each with its source), ``out``.md rendered from it
    (``render/scaling.py``) and ``out``.png for ``counts`` GPUs; returns the Markdown. Torch-free
    where the model's FLOP counts ship."""
    from gradientflow_repro import render
    from gradientflow_repro.provenance import git_commit

    data = projection_data(setup, counts, calibrate)
    out.parent.mkdir(parents=True, exist_ok=True)
    plot(data["speedup"], out.with_suffix(".png"), tuple(counts), paper=setup.is_paper)
    data.update(command=command, commit=git_commit() or "unknown", figure=out.with_suffix(".png").name,
                band=band, terms=list(terms))
    written = render.write_data(out.with_suffix(".json"), "scaling.projection", data)
    return render.render_file(written).read_text()

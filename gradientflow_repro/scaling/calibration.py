"""The scaling model's free parameters fitted on a named subset of published results, tested on the rest.

The model (``perfmodel``) prices communication from nominal link rates and lets overlap hide it
for free, so on its own it over-predicts every published result. Three costs close the gap, each
a named term of the model:
- ``Network.link_efficiency`` per fabric between nodes (what a ring's bus bandwidth reaches of the
  line rate), and the same factor on the nominal rate inside a node (``intra_efficiency``);
- ``Network.overlap_slowdown``, one value: backward stretched by that fraction of the
  communication time it overlaps;
- ``ModelProfile.step_overhead_s`` per framework: added to every step on more than one GPU; for a
  framework whose one process drives every GPU of its node (``ONE_PROCESS_PER_NODE``) the fitted
  value is per GPU the process drives beyond the first (``step_overhead_s``), since that host
  launches and synchronises the work of all of them.
``Network.local_work_slowdown`` is not fitted (no published row has local work: CSC, the fp16 wire,
PowerSGD); ``paper_band`` spans it.

The algorithm (``fit``), a least-squares fit by coordinate descent on grids:
1. start from the priors (``Parameters()``: efficiency 1, no slowdown, no overhead);
2. for each free parameter in turn, try every value of its grid with the others held and keep the
   one with the least sum of squared efficiency errors over the fitted rows;
3. repeat step 2 until a whole pass changes nothing (at most ``passes``), then once more on a grid
   a tenth as coarse around each value.
Tuning advice: a parameter that no fitted row depends on stays at its prior (the fit says which);
a fabric seen only by one or two rows trades off against the overhead, so fit fabrics with rows at
two GPU counts. Grids are coarse on purpose: the published numbers carry a point or two of noise.

Predictions are weak scaling, as the sources measure: per-GPU batch fixed, efficiency
speedup(N) / N (relative to ``base_gpus`` where a source's base is more than one GPU).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterable, Mapping, Optional, Sequence

from gradientflow_repro import variants
from gradientflow_repro.reproduction import lineup as reproduction_lineup
from gradientflow_repro.scaling import lineup
from gradientflow_repro.scaling import perfmodel as pm
from gradientflow_repro.scaling.projection import Setup
from gradientflow_repro.scaling.published import FABRICS, INTRA_NODE, ROWS, Published

# NCCL's maintainers: a ring's bus bandwidth is ~96% of an InfiniBand NIC's line rate with
# GPUDirect RDMA (nccl-tests#29, #119; nccl#307, #812): the prior for a fabric no fitted row measures
NCCL_IB_EFFICIENCY = 0.96
# The prior of a fabric no fitted row measures: a number, or the fabric whose fitted value it takes
# (50 Gbit/s Ethernet with RDMA-capable NICs, Goyal et al.: as 25 Gbit/s RoCE)
PRIORS: dict[str, float | str] = {"ib56": NCCL_IB_EFFICIENCY, "eth50": "roce25"}
# Upper bounds of the fitted values (an efficiency is at most 1)
BOUNDS = {"link": 1.0, "intra": 1.0, "slowdown": 1.0, "overhead": 0.2}


@dataclass
class Parameters:
    """The model's free parameters: per fabric (``published.FABRICS``), per intra-node kind
    (``published.INTRA_NODE``), one slowdown, per framework. Missing keys take the prior."""

    link_efficiency: dict[str, float] = field(default_factory=dict)
    intra_efficiency: dict[str, float] = field(default_factory=dict)
    overlap_slowdown: float = 0.0
    step_overhead_s: dict[str, float] = field(default_factory=dict)
    # not fitted (no published row has local work): None, as the overlap slowdown, or a sensitivity
    local_work_slowdown: Optional[float] = None

    def link(self, fabric: str) -> float:
        """A fabric's efficiency: fitted, else its prior (``PRIORS``), else 1."""
        if fabric in self.link_efficiency:
            return self.link_efficiency[fabric]
        prior = PRIORS.get(fabric, 1.0)
        return self.link(prior) if isinstance(prior, str) else prior

    def copy(self) -> "Parameters":
        return Parameters(dict(self.link_efficiency), dict(self.intra_efficiency), self.overlap_slowdown,
                          dict(self.step_overhead_s), self.local_work_slowdown)


# Frameworks whose one process drives every GPU of its node, with what says so: their host work per
# step grows with the GPUs it drives (``step_overhead_s``). TF's benchmarks on the DGX-1 show it in
# the fitted rows themselves: at 4 GPUs AlexNet's and VGG-16's steps exceed their single-GPU steps
# by the same time within a millisecond, though VGG-16 sends more than twice the bytes (``excess_s``;
# the table in ``results/model_check.md``). Horovod and PyTorch DDP run one process per GPU: one value per step.
ONE_PROCESS_PER_NODE = {
    "tf-replicated": "tf_cnn_benchmarks' replicated variable update: one process, a tower per GPU of the "
                     "node (TF benchmarks, May 2017); as PyTorch's single-process DataParallel, whose "
                     "per-step host work its maintainers name as why one process per GPU scales better",
}


def step_overhead_s(row: Published, params: Parameters, gpus: Optional[int] = None) -> float:
    """``row``'s framework overhead per step at ``gpus`` (default: the row's): the fitted value, or
    for a framework of ``ONE_PROCESS_PER_NODE`` that value per GPU beyond the first that its process
    drives (all of the node's, at most the GPUs in use)."""
    value = params.step_overhead_s.get(row.framework, 0.0)
    if row.framework in ONE_PROCESS_PER_NODE:
        value *= max(0, min(gpus or row.gpus, row.gpus_per_node) - 1)
    return value


def excess_s(row: Published) -> float:
    """Seconds by which the reported step exceeds the single-GPU step (weak scaling: the same
    images per GPU): what communication and every overhead cost together, from the source alone.
    For a row of one GPU's base only (``base_gpus`` 1)."""
    if row.base_gpus != 1:
        raise ValueError(f"{row.name}: its efficiency is relative to {row.base_gpus} GPUs, not one")
    single = row.images_per_gpu / row.single_gpu_images_s
    return single / row.reported - single


# A free parameter: (kind, key), kind one of "link", "intra", "slowdown", "overhead"
Free = tuple[str, str]
GRIDS: dict[str, tuple[float, ...]] = {
    "link": tuple(round(0.1 + 0.05 * i, 4) for i in range(19)),  # 0.1 .. 1.0
    "intra": tuple(round(0.1 + 0.05 * i, 4) for i in range(19)),
    "slowdown": tuple(round(0.05 * i, 4) for i in range(21)),  # 0 .. 1
    "overhead": tuple(round(0.002 * i, 4) for i in range(41)),  # 0 .. 80 ms
}
# The fitted subset's free parameters (what ``published.ROWS``' fitted rows measure)
FREE: tuple[Free, ...] = (("link", "roce25"), ("link", "tcp25"), ("link", "tcp40"), ("slowdown", ""),
                          ("overhead", "horovod"), ("intra", "nvlink-p100"), ("overhead", "tf-replicated"),
                          ("overhead", "pytorch-ddp"))


def get(params: Parameters, free: Free) -> float:
    kind, key = free
    if kind == "link":
        return params.link(key)
    if kind == "intra":
        return params.intra_efficiency.get(key, 1.0)
    if kind == "slowdown":
        return params.overlap_slowdown
    return params.step_overhead_s.get(key, 0.0)


def put(params: Parameters, free: Free, value: float) -> Parameters:
    kind, key = free
    out = params.copy()
    if kind == "link":
        out.link_efficiency[key] = value
    elif kind == "intra":
        out.intra_efficiency[key] = value
    elif kind == "slowdown":
        out.overlap_slowdown = value
    else:
        out.step_overhead_s[key] = value
    return out


ONE_NODE_LINK_GBPS = 8000.0  # a row on one node uses no link between nodes: any rate (1 TB/s) will do


def setup(row: Published, params: Parameters) -> Setup:
    """The row as the projection's ``Setup`` (the one definition of a cluster and a model, which
    ``scripts/simulate_scaling.py`` takes from the command line): its model and GPU, its cluster
    with the parameters' efficiencies, slowdown and its framework's overhead, NCCL, and the GPU's
    local work (CSC, the fp16 wire, PowerSGD) at the projection's memory rate."""
    return Setup(model=row.model, image_size=row.image_size, images_per_gpu=row.images_per_gpu,
                 single_gpu_images_s=row.single_gpu_images_s, link_gbps=row.link_gbps or ONE_NODE_LINK_GBPS,
                 gpus_per_node=row.gpus_per_node,
                 intra_node_GBps=INTRA_NODE[row.intra][0] * params.intra_efficiency.get(row.intra, 1.0),
                 latency_us=row.latency_us, strategies=(row.strategy,), nccl=True,
                 # NCCL's ring alone where the system predates NCCL's tree
                 nccl_algo="Ring" if row.ring_only else None,
                 link_efficiency=params.link(row.fabric), overlap_slowdown=params.overlap_slowdown,
                 local_work_slowdown=params.local_work_slowdown,
                 step_overhead_s=step_overhead_s(row, params))


def network(row: Published, params: Parameters) -> pm.Network:
    """The row's cluster with the parameters' efficiency and slowdown (NCCL carries the builtin):
    ``setup(row, params).network()``."""
    return setup(row, params).network()


def strategy(row: Published) -> pm.Strategy:
    """The row's registered strategy."""
    return pm.strategy_of(row.strategy)


def predicted_efficiency(row: Published, params: Parameters, profile: pm.ModelProfile) -> float:
    """The model's efficiency for ``row`` (``profile``: the row's model without overhead)."""
    net, chosen = network(row, params), strategy(row)

    def at(gpus: int) -> float:
        return pm.speedup(replace(profile, step_overhead_s=step_overhead_s(row, params, gpus)), gpus, net, chosen)

    at_n = at(row.gpus)
    base = at(row.base_gpus) if row.base_gpus > 1 else 1.0
    return at_n / base / (row.gpus / row.base_gpus)


def row_profile(row: Published) -> pm.ModelProfile:
    """A row's profile from FLOPs (shipped, or counted with torch), with the GPU's local work priced
    as the projection prices it, and no overhead: ``setup(row, Parameters()).profile()``."""
    return setup(row, Parameters()).profile()


def loss(rows: Sequence[Published], params: Parameters, profiles: Mapping[str, pm.ModelProfile]) -> float:
    """Sum of squared efficiency errors (in points) over ``rows``."""
    return sum((100 * (predicted_efficiency(r, params, profiles[r.name]) - r.reported)) ** 2 for r in rows)


def fit(rows: Sequence[Published], profiles: Mapping[str, pm.ModelProfile], free: Iterable[Free] = FREE,
        start: Optional[Parameters] = None, passes: int = 4) -> tuple[Parameters, float]:
    """Least squares by coordinate descent on ``GRIDS`` (the module's algorithm); returns the
    parameters and the root-mean-square error in points over ``rows``."""
    params, free = (start or Parameters()).copy(), list(free)
    best = loss(rows, params, profiles)
    for fine in (False, True):
        for _ in range(passes):
            moved = False
            for item in free:
                grid = GRIDS[item[0]]
                if fine:
                    step = (grid[1] - grid[0]) / 10
                    centre = get(params, item)
                    grid = tuple(value for i in range(-9, 10)
                                 if grid[0] <= (value := round(centre + step * i, 6)) <= BOUNDS[item[0]])
                for value in grid:
                    trial = put(params, item, value)
                    score = loss(rows, trial, profiles)
                    if score < best - 1e-9:
                        params, best, moved = trial, score, True
            if not moved:
                break
    return params, math.sqrt(best / max(1, len(rows)))


@dataclass(frozen=True)
class Checked:
    row: Published
    predicted: float  # efficiency
    error_points: float  # predicted - reported, in points of efficiency

    @property
    def within_goal(self) -> bool:
        """Within 5 points of efficiency, or 15% of the speedup where the source gives only that."""
        if self.row.reported_speedup is not None:
            return abs(self.predicted / self.row.reported - 1) <= 0.15
        return abs(self.error_points) <= 5


def check(rows: Sequence[Published], params: Parameters, profiles: Mapping[str, pm.ModelProfile]) -> list[Checked]:
    out = []
    for row in rows:
        predicted = predicted_efficiency(row, params, profiles[row.name])
        out.append(Checked(row, predicted, 100 * (predicted - row.reported)))
    return out


def calibrate(rows: Sequence[Published] = ROWS,
              profile_of: Callable[[Published], pm.ModelProfile] = row_profile
              ) -> tuple[Parameters, float, list[Checked], list[Checked], dict[str, pm.ModelProfile]]:
    """Fit on the rows marked ``fitted``; check every row. Returns the parameters, the fit's RMS
    error in points, the fitted rows' and the test rows' checks, and the profiles used."""
    profiles = {row.name: profile_of(row) for row in rows}
    fitted = [row for row in rows if row.fitted]
    params, rms = fit(fitted, profiles)
    return (params, rms, check(fitted, params, profiles), check([r for r in rows if not r.fitted], params, profiles),
            profiles)


def rms_points(checked: Sequence[Checked]) -> float:
    return math.sqrt(sum(c.error_points ** 2 for c in checked) / max(1, len(checked)))


# ------------------------------------------------------------------ the paper's projection with its spread
PAPER_GPUS_PER_NODE = (4, 8)  # not stated by the paper
# single-GPU AlexNet throughput (images/s): a P100 (TF benchmarks, DGX-1, batch 512), the paper's own
# implied figure (``perfmodel.PAPER_SINGLE_GPU_IMAGES_S``), and a V100 taken as twice a P100 (assumed)
PAPER_SINGLE_GPU = {"P100 (TF benchmarks)": 2987.0, "implied by the paper": pm.PAPER_SINGLE_GPU_IMAGES_S,
                    "V100 (assumed 2x P100)": 5974.0}


# What a researcher would run instead at the paper's scale: DDP, and PyTorch's own fp16 and PowerSGD
# hooks (the peers of `make reproduce` that the model projects)
# Local work beside backward (``Network.local_work_slowdown``): hidden as communication is (None),
# or none of it hidden (1: on a GPU it takes SMs and memory bandwidth for all its time): not stated
# by the paper, and not measured on a GPU here
PAPER_LOCAL_WORK_SLOWDOWN: tuple[Optional[float], ...] = (None, 1.0)
PEER_LABELS = ("ddp", *(label for label in reproduction_lineup.PEER_LABELS if label in lineup.PROJECTION))


def paper_band(params: Parameters, test_rms_points: float,
               profile_of: Callable[[Published], pm.ModelProfile] = row_profile) -> dict[str, dict]:
    """The paper's setups projected over its unknowns, with the fitted parameters.

    For each of the full stack (``gradientflow``), dense lazy allreduce with the fp16 wire
    (``variants.LAZY_FP16``), DDP and the peers in PyTorch (``PEER_LABELS``) at 512 GPUs, and the
    open-source baseline (``allreduce``) at 64: the
    speedup for every combination of GPUs per node (``PAPER_GPUS_PER_NODE``), single-GPU throughput
    (``PAPER_SINGLE_GPU``), framework overhead (none, or Horovod's fitted one) and how much of the
    local work backward hides (``PAPER_LOCAL_WORK_SLOWDOWN``), on 56 Gbit/s at the fitted (or prior)
    FDR efficiency. The band is the lowest and highest of those, widened by the test rows' RMS error
    (points of efficiency times the GPUs).

    Returns ``{label: {"gpus", "reported", "low", "high", "central", "grid": [{"gpus_per_node",
    "gpu", "overhead_s", "local_work_slowdown", "speedup"}, ...]}}``; ``central``: 8 GPUs per node,
    the paper's implied throughput, no overhead, local work hidden as communication is."""
    paper = {row.strategy: row for row in ROWS if row.name.startswith("the paper")}
    targets = (("gradientflow", 512, paper["gradientflow"].reported_speedup), (variants.LAZY_FP16, 512, None),
               *((label, 512, None) for label in PEER_LABELS),
               ("allreduce", 64, paper["allreduce"].reported_speedup))
    out: dict[str, dict] = {}
    overheads = sorted({0.0, params.step_overhead_s.get("horovod", 0.0)})
    for label, gpus, reported in targets:
        grid = []
        for per_node in PAPER_GPUS_PER_NODE:
            for gpu, single in PAPER_SINGLE_GPU.items():
                for overhead in overheads:
                    for local in PAPER_LOCAL_WORK_SLOWDOWN:
                        row = replace(paper["gradientflow"], strategy=label, gpus=gpus, gpus_per_node=per_node,
                                      single_gpu_images_s=single, framework="paper")
                        trial = replace(put(params, ("overhead", "paper"), overhead), local_work_slowdown=local)
                        speedup = gpus * predicted_efficiency(row, trial, profile_of(row))
                        grid.append({"gpus_per_node": per_node, "gpu": gpu, "overhead_s": overhead,
                                     "local_work_slowdown": local, "speedup": speedup})
        values = [g["speedup"] for g in grid]
        central = next(g["speedup"] for g in grid if g["gpus_per_node"] == 8 and g["gpu"] == "implied by the paper"
                       and g["overhead_s"] == 0.0 and g["local_work_slowdown"] is None)
        spread = test_rms_points / 100 * gpus
        out[label] = {"gpus": gpus, "reported": reported, "central": central, "low": max(0.0, min(values) - spread),
                      "high": min(float(gpus), max(values) + spread), "grid": grid}
    return out


def paper_decomposition(params: Parameters, overhead_s: float = 0.0,
                        profile_of: Callable[[Published], pm.ModelProfile] = row_profile) -> list[tuple[str, float]]:
    """The full stack at 512 GPUs on the paper's central setup as the calibration terms are added one
    at a time: (what is added, speedup). Shows which term takes how much of the gap to 410.2x."""
    row = next(r for r in ROWS if r.strategy == "gradientflow" and r.name.startswith("the paper"))
    row = replace(row, framework="paper")
    profile = profile_of(row)
    with_overhead = Parameters({"ib56": params.link("ib56")}, {}, params.overlap_slowdown, {"paper": overhead_s})
    steps = [("nominal links, free overlap, no overhead", Parameters()),
             (f"+ link efficiency {params.link('ib56'):.2f} (56 Gbit/s FDR)",
              Parameters({"ib56": params.link("ib56")})),
             (f"+ overlap slowdown {params.overlap_slowdown:.2f}",
              Parameters({"ib56": params.link("ib56")}, {}, params.overlap_slowdown)),
             (f"+ step overhead {overhead_s * 1e3:.1f} ms", with_overhead),
             ("+ local work not hidden by backward (its slowdown 1)", replace(with_overhead, local_work_slowdown=1.0))]
    return [(what, row.gpus * predicted_efficiency(row, step, profile)) for what, step in steps]


COMMITTED = "results/model_check.json"  # the committed calibration (``scripts/model_check.py --report``)


def committed(path: Optional[Path] = None) -> Optional[dict]:
    """The calibration ``scripts/model_check.py`` wrote (``COMMITTED`` unless ``path``): its data, or
    None where it has not been written. Torch-free: a JSON file."""
    from gradientflow_repro import REPO

    path = path or REPO / COMMITTED
    return json.loads(path.read_text()) if path.exists() else None


def band_section(path: Optional[Path] = None) -> Optional[dict]:
    """The paper's band as the committed calibration holds it (``committed``), without each label's
    grid: what ``scripts/simulate_scaling.py`` shows beside the paper's projection. None when it has
    not been written."""
    data = committed(path)
    if data is None:
        return None
    return {"command": data["command"], "commit": data["environment"].get("git_commit", "unknown"),
            "fit_rms_points": data["fit_rms_points"], "test_rms_points": data["test_rms_points"],
            "paper_band": {label: {k: v for k, v in entry.items() if k != "grid"}
                           for label, entry in data["paper_band"].items()}}


def fabric_of(link_gbps: float) -> Optional[str]:
    """The fabric of ``published.FABRICS`` whose nominal rate is ``link_gbps``, where exactly one is."""
    matching = [key for key in FABRICS if key != "none" and _fabric_gbps(key) == link_gbps]
    return matching[0] if len(matching) == 1 else None


def _fabric_gbps(fabric: str) -> Optional[float]:
    rates = [row.link_gbps for row in ROWS if row.fabric == fabric]
    return rates[0] if rates else None


def terms(fabric: Optional[str], framework: Optional[str], gpus_per_node: int,
          path: Optional[Path] = None) -> Optional[list[dict]]:
    """The fitted terms a projection takes by default from the committed calibration (``committed``),
    each as ``{"term", "option", "value", "shown", "source"}``: the link efficiency of ``fabric``
    (fitted on the rows that measure it, else its prior; None: nominal), the overlap slowdown, and
    the per-step overhead of ``framework`` (None: none; for one process driving a node's GPUs, its
    value per GPU times ``gpus_per_node`` - 1). None where no calibration is written."""
    data = committed(path)
    if data is None:
        return None
    params = Parameters(**data["parameters"])
    fitted = [row for row in data["rows"] if row["subset"] == "fitted"]
    where = f"`{(path or COMMITTED)}` (`{data['command']}`, commit {data['environment'].get('git_commit', 'unknown')})"

    def on(rows: list[dict]) -> str:
        return f"fitted on {len(rows)} published rows: " + "; ".join(row["name"] for row in rows)

    if fabric is None:
        link = (1.0, "nominal: no fabric of `scaling/published.py` has this rate alone (name one with --fabric)")
    elif fabric in params.link_efficiency:
        link = (params.link(fabric), f"{where}, {on([r for r in fitted if r['fabric'] == fabric])}")
    else:
        prior = PRIORS.get(fabric, 1.0)
        said = f"as {prior}'s fit" if isinstance(prior, str) else "NCCL's maintainers' figure for InfiniBand"
        link = (params.link(fabric), f"prior ({said}, `calibration.PRIORS`): no fitted row measures {fabric}")
    out = [{"term": f"link efficiency ({fabric or 'no fabric named'}: {FABRICS.get(fabric, 'nominal rate')})",
            "option": "link_efficiency", "value": link[0], "shown": f"{link[0]:g}", "source": link[1]},
           {"term": "overlap slowdown", "option": "overlap_slowdown", "value": params.overlap_slowdown,
            "shown": f"{params.overlap_slowdown:g}",
            "source": f"{where}, fitted on the {len(fitted)} rows of its fitted subset"}]
    if framework is None:
        out.append({"term": "framework overhead per step", "option": "step_overhead_s", "value": 0.0, "shown": "0 ms",
                    "source": "no framework named (--framework: "
                              + ", ".join(sorted(params.step_overhead_s)) + ")"})
    else:
        value = params.step_overhead_s.get(framework, 0.0)
        per_gpu = framework in ONE_PROCESS_PER_NODE
        total = value * max(0, gpus_per_node - 1) if per_gpu else value
        out.append({"term": f"framework overhead per step ({framework})", "option": "step_overhead_s", "value": total,
                    "shown": f"{1e3 * total:g} ms" + (f" ({1e3 * value:g} ms per GPU beyond the first of a node)"
                                                      if per_gpu else ""),
                    "source": f"{where}, {on([r for r in fitted if r['framework'] == framework])}"})
    return out

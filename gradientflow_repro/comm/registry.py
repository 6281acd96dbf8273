"""The registry of communication strategies: the one place that names, labels and lists them.

A strategy is two things:

1. its preset, ``configs/comm/NAME.yaml`` (Hydra's pattern: ``comm=NAME`` on the command line),
   which names the strategy and sets its five knobs (``knobs.py``) and its sizes;
2. its ``Entry`` here, which says
   - how it is built: the factory (``factory.py``) makes the sum from ``algorithm`` (``knobs.summing``),
     the fp16 wire from ``wire``, and the communicator from ``fusion`` and ``sparsity``: a
     ``Sparsifier`` of ``SPARSIFIERS`` with a ``builder`` builds its own communicator, otherwise the
     fusion decides (per-tensor allreduce, the lazy pool, DDP). An entry that brings a new sparsifier
     carries it (``Entry.sparsifier``);
   - how it is labelled: its ``Variant``s, each a label and the ``comm.*`` options that label stands
     for on top of the preset (``ring+fp16`` is the ``ring`` preset with ``wire: fp16``);
   - which lists each label belongs to (``LADDER``, ``SPARSE_VARIANTS``, ``CLUSTER_BENCH``,
     ``COMM_BENCH``, ``GPU_CHECK``, ``PROJECTION``), in the order of the entries, then of their variants;
   - how the scaling model prices it: by its sparsifier's ``pricing`` rule (``PRICING_RULES``). A
     rule the model does not know is refused, by ``register`` and by the model itself, so a new
     sparsifier is never priced as if it sent every gradient.

Everything that names strategies reads them here: config validation (``knobs.resolve`` accepts
exactly the registered names), the factory, the scaling model (``perfmodel``, ``projection``), the
ladder of ``make reproduce`` (``reproduction/``), the benchmarks (``bench/``) and the GPU check.
Labels written by older runs into stored facts are read through ``ALIASES`` (``canonical``).

Adding a strategy (docs/extending.md walks through an example):

1. its code, if it has any, in one module of ``comm/`` (a ``Communicator``, ``base.py``);
2. its preset, ``configs/comm/NAME.yaml``, setting every knob;
3. its ``Entry`` in ``ENTRIES`` below (or ``register(entry)`` from outside, e.g. in a test).

Torch-free, like ``knobs.py``: the config check and the analytic model import it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Union

from gradientflow_repro import REPO

PRESET_DIR = REPO / "configs" / "comm"

# The lists a label can belong to.
LADDER = "ladder"  # the paper's ablation as `make reproduce` runs it, one technique per rung; the model checks it
SPARSE_VARIANTS = "sparse_variants"  # trained beside the ladder for CSC's convergence cost (not speed rungs)
CLUSTER_BENCH = "cluster_bench"  # bench/cluster.py: communication alone on the emulated cluster
COMM_BENCH = "comm_bench"  # bench/comm.py: real gradient shapes on loopback (results/comm.md)
GPU_CHECK = "gpu_check"  # gpu_check: communicators on CUDA tensors
PROJECTION = "projection"  # scaling/projection.py: the strategies results/scaling.md projects by default
# what researchers would pick instead (PyTorch's own DDP hooks), and the paper's stack as published:
# trained beside the ladder by `make reproduce` and `make convergence` (not rungs of the paper's ablation)
PEERS = "peers"
LISTS = (LADDER, SPARSE_VARIANTS, PEERS, CLUSTER_BENCH, COMM_BENCH, GPU_CHECK, PROJECTION)

# How the scaling model (``perfmodel.Strategy.from_knobs``) prices what a sparsifier sends:
# - ``dense``: every gradient element, every step;
# - ``chunks``: ceil(density x chunks) whole chunks of ``chunk_size`` elements of each pool part's
#   multi-dimensional tensors, its one-dimensional tensors whole, after one small allreduce of one
#   norm per chunk (coarse-grained selection, with no work on the optimizer's side);
# - ``csc``: ``chunks``, and CSC's momentum correction: it takes over the optimizer's momentum,
#   weight decay and adaptation, and under LARS sends its trust ratios' noise sketches with the norms;
# - ``low_rank``: PowerSGD (Vogels et al. 2019): each matrix-shaped gradient (n x m) as two factors of
#   rank r, P (n x r) and Q (m x r), in two allreduces per bucket; vectors (biases, BatchNorm) whole.
PRICING_RULES = ("dense", "chunks", "csc", "low_rank")

# Labels that code refers to by name (a check, a goal, a report's row): written here once, read as
# these constants everywhere else (a strategy's own name, ``gradientflow``, is its label too)
RING_FP16 = "ring+fp16"  # the ring preset with the fp16 wire
LAZY_FP16 = "ring+fp16+lazy"  # the lazy preset with the fp16 wire: the full stack less CSC
# the full stack forced onto our flat ring (on NCCL too, where the backend's allreduce would otherwise
# carry it with NCCL's tuner: no configuration forces NCCL's ring, knobs.Summing)
FLAT = "gradientflow (flat)"
HIERARCHICAL = "gradientflow (hierarchical)"  # the full stack forced onto the two-level ring
DDP_STYLE = "ddp-style bucketed builtin"  # DDP's 25 MB buckets of builtin allreduces, done by our pool


@dataclass(frozen=True)
class Sparsifier:
    """A value of ``comm.sparsity``: what the factory builds for it and how the model prices it.

    ``builder``: the communicator's builder, ``fn(knobs, device, sum_fn, lr_warmup_epochs) ->
    Communicator``, as ``"module:function"`` (imported when first built: this module stays
    torch-free) or the function itself; None: the factory's choice by ``comm.fusion``.
    ``needs_pool``: works over the lazy pool only (``comm.fusion=lazy``); ``fusion``: the one value of
    ``comm.fusion`` it works over, in general (PowerSGD: ``ddp``, as a DDP hook); ``knobs.resolve``
    refuses any other."""

    name: str
    pricing: str
    builder: Union[str, Callable[..., Any], None] = None
    needs_pool: bool = False
    fusion: Optional[str] = None

    @property
    def required_fusion(self) -> Optional[str]:
        """The ``comm.fusion`` this sparsifier needs (None: any)."""
        return "lazy" if self.needs_pool else self.fusion


@dataclass(frozen=True)
class Variant:
    """One labelled configuration of a strategy: ``options`` (``comm.*`` keys) over its preset, and
    the lists it belongs to. ``layout_keys``: keys a benchmark fills from its layout (``ranks_per_node``)."""

    label: str
    options: Mapping[str, Any] = field(default_factory=dict)
    lists: tuple[str, ...] = ()
    layout_keys: tuple[str, ...] = ()


@dataclass(frozen=True)
class Entry:
    """A strategy: ``name`` (its preset is ``configs/comm/NAME.yaml``, or ``preset`` where it ships
    none: a strategy registered from outside the package), what it is, its labelled variants, and
    the sparsifier it brings, if new."""

    name: str
    summary: str
    variants: tuple[Variant, ...] = ()
    preset: Optional[Mapping[str, Any]] = None  # the YAML's keys (strategy aside); None: read the YAML
    sparsifier: Optional[Sparsifier] = None


SPARSIFIERS: dict[str, Sparsifier] = {
    "dense": Sparsifier("dense", pricing="dense"),
    # coarse-grained sparse communication (comm/csc/), built over the pool
    "csc": Sparsifier("csc", pricing="csc", builder="gradientflow_repro.comm.factory:csc_communicator",
                      needs_pool=True),
    # PyTorch's PowerSGD DDP hook (torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook)
    "powersgd": Sparsifier("powersgd", pricing="low_rank",
                           builder="gradientflow_repro.comm.factory:powersgd_communicator", fusion="ddp"),
}

# The comm bench's sweeps: the pool's part size with and without overlap, and CSC's density, all
# on the backend's allreduce (what the pool and the sparsifier change, not the ring)
_POOL_SWEEP = tuple(Variant(f"lazy {mb} MB, overlap {'on' if overlap else 'off'}",
                            {"algorithm": "builtin", "bucket_mb": mb, "overlap": overlap}, (COMM_BENCH,))
                    for mb in (1, 8, 32, 128) for overlap in (True, False))
# per-tensor messages overlapped with backward, as systems without fusion send them (TensorFlow's
# replicated NCCL, Caffe2): the pool of 1 MB parts, overlapped (the scaling model's published rows)
PER_TENSOR_OVERLAPPED = next(v.label for v in _POOL_SWEEP
                             if v.options["bucket_mb"] == 1 and v.options["overlap"])
_CSC_SWEEP = tuple(Variant(f"csc density {density}", {"algorithm": "builtin", "density": density,
                                                       "csc_warmup_epochs": 0.0, "bucket_mb": 32}, (COMM_BENCH,))
                   for density in (1.0, 0.1, 0.01))

ENTRIES: tuple[Entry, ...] = (
    Entry("allreduce", "naive baseline: one builtin allreduce per gradient tensor after backward",
          (Variant("allreduce", {}, (LADDER, CLUSTER_BENCH, COMM_BENCH, GPU_CHECK, PROJECTION)),)),
    Entry("ddp", "PyTorch DistributedDataParallel: 25 MB buckets allreduced during backward",
          (Variant("ddp", {}, (LADDER, CLUSTER_BENCH, COMM_BENCH, GPU_CHECK, PROJECTION)),)),
    Entry("ring", "per-tensor ring allreduce from send/recv (ring.py)",
          (Variant("ring", {}, (LADDER, CLUSTER_BENCH, PROJECTION)),
           Variant(RING_FP16, {"wire": "fp16"}, (LADDER, CLUSTER_BENCH, PROJECTION)))),
    Entry("lazy", "lazy allreduce: the memory pool's parts summed by the ring, overlapped with backward (lazy.py)",
          (Variant("lazy", {}, (CLUSTER_BENCH, GPU_CHECK)),
           Variant(LAZY_FP16, {"wire": "fp16"}, (LADDER, GPU_CHECK, PROJECTION)),
           Variant("lazy two-level", {"wire": "fp16", "algorithm": "hierarchical"}, (PROJECTION,)),  # Jia et al.
           # DDP's own 25 MB buckets of builtin allreduces, done by our pool: no DDP needed
           Variant(DDP_STYLE, {"algorithm": "builtin", "bucket_mb": 25, "wire": "fp32"},
                   (CLUSTER_BENCH,)),
           *_POOL_SWEEP)),
    Entry("csc", "coarse-grained sparse communication over the lazy pool, fp32 wire (comm/csc/)",
          (Variant("csc", {}, (CLUSTER_BENCH, GPU_CHECK)), *_CSC_SWEEP)),
    Entry("gradientflow", "the paper's full stack: ring (two-level on multi-rank nodes), fp16 wire, lazy pool, CSC",
          (Variant("gradientflow", {}, (LADDER, GPU_CHECK, PROJECTION)),
           Variant(FLAT, {"algorithm": "ring", "implementation": "ours"}, (CLUSTER_BENCH, PROJECTION)),
           Variant(HIERARCHICAL, {"algorithm": "hierarchical"}, (CLUSTER_BENCH,),
                   layout_keys=("ranks_per_node",)),
           # CSC's convergence at a lower density, and with DGC's momentum correction and masking (the
           # velocity accumulated before sparsification; our default leaves momentum to the optimizer):
           # docs/notes/2026-12-06-csc-choices-in-the-paper-regime.md
           Variant("gradientflow@0.01", {"density": 0.01}, (SPARSE_VARIANTS,)),
           Variant("gradientflow-mc", {"momentum_correction": True, "momentum_masking": True},
                   (SPARSE_VARIANTS,)))),
    Entry("hierarchical", "intra-node reduce, ring among node leaders, intra-node broadcast (hierarchical.py)"),
    # the paper's stack as published: gradientflow without our two additions (release cap, trust-ratio
    # noise correction), so the report shows what they buy
    Entry("gradientflow-paper", "the paper's stack as published: gradientflow without our release cap and "
          "trust-ratio noise correction",
          (Variant("gradientflow-paper", {}, (PEERS,)),)),
    # what researchers would use instead: PyTorch's own communication hooks, not ours
    Entry("ddp-fp16", "PyTorch DDP with its own fp16_compress_hook (as Horovod's fp16 compression)",
          (Variant("ddp-fp16", {}, (PEERS, CLUSTER_BENCH, COMM_BENCH, PROJECTION)),)),
    Entry("powersgd", "PyTorch DDP with its own PowerSGD hook (Vogels et al. 2019): rank-4 factors, error "
          "feedback, warm start, after the same dense warm-up as CSC",
          (Variant("powersgd", {}, (PEERS, CLUSTER_BENCH, COMM_BENCH, PROJECTION)),)),
)

STRATEGIES: dict[str, Entry] = {entry.name: entry for entry in ENTRIES}

# Labels older code wrote (into results and stored facts) -> the label now used for the same options
ALIASES: dict[str, str] = {
    "gradientflow, flat ring": FLAT,  # scaling projection
    "lazy+fp16 wire": LAZY_FP16,  # GPU check
    "allreduce (per tensor)": "allreduce",  # comm bench
    "ddp (25 MB buckets)": "ddp",  # comm bench
}


def register(entry: Entry) -> None:
    """Add ``entry`` (and the sparsifier it brings) to the registry. Raises ValueError on a name or
    label taken already, a list or pricing rule nobody knows, or a variant of another strategy."""
    if entry.name in STRATEGIES:
        raise ValueError(f"strategy {entry.name!r} is registered already")
    taken = set(variants()) | set(ALIASES)
    for variant in entry.variants:
        if variant.label in taken:
            raise ValueError(f"label {variant.label!r} is registered already")
        unknown = set(variant.lists) - set(LISTS)
        if unknown:
            raise ValueError(f"label {variant.label!r}: no list {', '.join(sorted(unknown))}; "
                             f"lists are {', '.join(LISTS)}")
        if "strategy" in variant.options:
            raise ValueError(f"label {variant.label!r}: its strategy is its entry's, {entry.name!r}")
    if entry.sparsifier is not None:
        if entry.sparsifier.name in SPARSIFIERS:
            raise ValueError(f"sparsifier {entry.sparsifier.name!r} is registered already")
        if entry.sparsifier.pricing not in PRICING_RULES:
            raise ValueError(f"sparsifier {entry.sparsifier.name!r}: no pricing rule {entry.sparsifier.pricing!r}; "
                             f"the model prices {', '.join(PRICING_RULES)}")
        SPARSIFIERS[entry.sparsifier.name] = entry.sparsifier
    STRATEGIES[entry.name] = entry


def names() -> tuple[str, ...]:
    """Every registered strategy (preset) name, in registration order."""
    return tuple(STRATEGIES)


@lru_cache(maxsize=None)
def _read_yaml(path: Path) -> tuple[tuple[str, Any], ...]:
    import yaml  # here: the collective helpers import knobs.py, and a machine with nothing but torch
    # must be able to import them (the GPU check)

    return tuple((yaml.safe_load(path.read_text()) or {}).items())


def preset(name: str) -> dict[str, Any]:
    """The keys strategy ``name``'s preset sets (its YAML, or the entry's own), ``strategy`` aside.
    Raises ValueError for an unregistered name or a YAML that names another strategy."""
    entry = STRATEGIES.get(name)
    if entry is None:
        raise ValueError(f"no strategy {name!r}; registered are {', '.join(names())}")
    if entry.preset is not None:
        return dict(entry.preset)
    path = PRESET_DIR / f"{name}.yaml"
    if not path.is_file():
        raise ValueError(f"strategy {name!r} is registered but has no preset {path.name} in configs/comm/")
    values = dict(_read_yaml(path))
    if values.pop("strategy", None) != name:
        raise ValueError(f"{path}: 'strategy' must be {name!r}, the file's name")
    return values


def unregistered_presets() -> list[str]:
    """Presets of ``configs/comm/`` that no entry registers (each must have one)."""
    return sorted(path.stem for path in PRESET_DIR.glob("*.yaml") if path.stem not in STRATEGIES)


def variants() -> dict[str, tuple[Entry, Variant]]:
    """Every label -> its strategy's entry and its variant, in the order of the entries."""
    return {variant.label: (entry, variant) for entry in STRATEGIES.values() for variant in entry.variants}


def labels(list_name: str) -> tuple[str, ...]:
    """The labels of list ``list_name`` (one of ``LISTS``), in the order of the entries."""
    if list_name not in LISTS:
        raise ValueError(f"no list {list_name!r}; lists are {', '.join(LISTS)}")
    return tuple(label for label, (_, variant) in variants().items() if list_name in variant.lists)


def canonical(label: str) -> str:
    """``label`` as it is written now: an old label (``ALIASES``) becomes its current one."""
    return ALIASES.get(label, label)


def known(label: str) -> bool:
    """Whether ``options`` takes ``label``: a label, an old label or a strategy's name."""
    return canonical(label) in variants() or label in STRATEGIES


def options(label: str, ranks_per_node: Optional[int] = None) -> dict[str, Any]:
    """The ``comm.*`` options ``label`` stands for: ``strategy`` first, then its variant's keys (the
    layout's ``ranks_per_node`` where the variant takes it from the layout). A strategy's name that
    is no label stands for its preset as it is; an old label for its current one."""
    found = variants().get(canonical(label))
    if found is None:
        if label in STRATEGIES:
            return {"strategy": label}
        raise ValueError(f"unknown strategy label {label!r}: known are {', '.join(variants())}")
    entry, variant = found
    chosen = {"strategy": entry.name, **variant.options}
    if "ranks_per_node" in variant.layout_keys:
        chosen["ranks_per_node"] = ranks_per_node
    return chosen


def options_of(list_name: str) -> dict[str, dict[str, Any]]:
    """Label -> ``comm.*`` options for every label of list ``list_name``."""
    return {label: options(label) for label in labels(list_name)}


def sparsifier(name: str) -> Sparsifier:
    """The registered sparsifier ``name`` (a value of ``comm.sparsity``). Raises ValueError."""
    if name not in SPARSIFIERS:
        raise ValueError(f"config key 'comm.sparsity' = {name!r}: allowed values are {', '.join(SPARSIFIERS)}")
    return SPARSIFIERS[name]


def load(builder: Union[str, Callable[..., Any]]) -> Callable[..., Any]:
    """A builder given as ``"module:function"``, imported; a function as it is."""
    if callable(builder):
        return builder
    module, _, attribute = builder.partition(":")
    return getattr(importlib.import_module(module), attribute)

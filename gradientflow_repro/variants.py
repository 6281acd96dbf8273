"""The labelled variants the tooling compares: a label -> the ``comm.*`` options it stands for.

A strategy is a preset (``comm/registry.py``); the tools compare presets and variants of them:
``ring+fp16`` is the ``ring`` preset with ``wire: fp16``, ``gradientflow (flat)`` the full stack
forced onto our flat ring. Each label is written here once, and every tool reads it here: the ladder
of ``make reproduce`` (``reproduction/lineup.py``), the benchmarks (``bench/lineup.py``), the
projection (``scaling/lineup.py``), the GPU check (``gpu_check/lineup.py``): each of those says
which labels it runs, in which order. A strategy's name is a label too, for its preset as it is.
Labels older code wrote into stored results are read through ``ALIASES`` (``canonical``).

The library never reads this module: it builds from options (``comm/plan.py``). Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from gradientflow_repro.comm import registry


@dataclass(frozen=True)
class Variant:
    """One labelled configuration: ``options`` (``comm.*`` keys, ``strategy`` first) and the keys a
    benchmark fills from its layout (``layout_keys``: ``ranks_per_node``)."""

    label: str
    options: Mapping[str, Any] = field(default_factory=dict)
    layout_keys: tuple[str, ...] = ()


# Labels that code refers to by name (a check, a goal, a report's row): written here once, read as
# these constants everywhere else (a strategy's own name, ``gradientflow``, is its label too)
RING_FP16 = "ring+fp16"  # the ring preset with the fp16 wire
LAZY_FP16 = "ring+fp16+lazy"  # the lazy preset with the fp16 wire: the full stack less CSC
# the full stack forced onto our flat ring (on NCCL too, where the backend's allreduce would otherwise
# carry it with NCCL's tuner: no configuration forces NCCL's ring, knobs.Summing)
FLAT = "gradientflow (flat)"
HIERARCHICAL = "gradientflow (hierarchical)"  # the full stack forced onto the two-level ring
LAZY_TWO_LEVEL = "lazy two-level"  # the lazy pool on the two-level ring, fp16 wire (Jia et al.)
DDP_STYLE = "ddp-style bucketed builtin"  # DDP's 25 MB buckets of builtin allreduces, done by our pool
LOW_DENSITY = "gradientflow@0.01"  # CSC's convergence at a tenth of the default density
# DGC's momentum correction and masking (the velocity accumulated before sparsification; our default
# leaves momentum to the optimizer): docs/notes/2026-12-06-csc-choices-in-the-paper-regime.md
MOMENTUM_CORRECTED = "gradientflow-mc"

# The comm bench's sweeps: the pool's part size with and without overlap, and CSC's density, all
# on the backend's allreduce (what the pool and the sparsifier change, not the ring)
POOL_SWEEP = tuple(Variant(f"lazy {mb} MB, overlap {'on' if overlap else 'off'}",
                           {"strategy": "lazy", "algorithm": "builtin", "bucket_mb": mb, "overlap": overlap})
                   for mb in (1, 8, 32, 128) for overlap in (True, False))
# per-tensor messages overlapped with backward, as systems without fusion send them (TensorFlow's
# replicated NCCL, Caffe2): the pool of 1 MB parts, overlapped (the scaling model's published rows)
PER_TENSOR_OVERLAPPED = next(v.label for v in POOL_SWEEP if v.options["bucket_mb"] == 1 and v.options["overlap"])
CSC_SWEEP = tuple(Variant(f"csc density {density}", {"strategy": "csc", "algorithm": "builtin", "density": density,
                                                      "csc_warmup_epochs": 0.0, "bucket_mb": 32})
                  for density in (1.0, 0.1, 0.01))

VARIANTS: tuple[Variant, ...] = (
    Variant(RING_FP16, {"strategy": "ring", "wire": "fp16"}),
    Variant(LAZY_FP16, {"strategy": "lazy", "wire": "fp16"}),
    Variant(LAZY_TWO_LEVEL, {"strategy": "lazy", "wire": "fp16", "algorithm": "hierarchical"}),
    # DDP's own 25 MB buckets of builtin allreduces, done by our pool: no DDP needed
    Variant(DDP_STYLE, {"strategy": "lazy", "algorithm": "builtin", "bucket_mb": 25, "wire": "fp32"}),
    *POOL_SWEEP,
    *CSC_SWEEP,
    Variant(FLAT, {"strategy": "gradientflow", "algorithm": "ring", "implementation": "ours"}),
    Variant(HIERARCHICAL, {"strategy": "gradientflow", "algorithm": "hierarchical"},
            layout_keys=("ranks_per_node",)),
    Variant(LOW_DENSITY, {"strategy": "gradientflow", "density": 0.01}),
    Variant(MOMENTUM_CORRECTED, {"strategy": "gradientflow", "momentum_correction": True,
                                 "momentum_masking": True}),
)

# Labels older code wrote (into results and stored facts) -> the label now used for the same options
ALIASES: dict[str, str] = {
    "gradientflow, flat ring": FLAT,  # scaling projection
    "lazy+fp16 wire": LAZY_FP16,  # GPU check
    "allreduce (per tensor)": "allreduce",  # comm bench
    "ddp (25 MB buckets)": "ddp",  # comm bench
}


def variants() -> dict[str, Variant]:
    """Every label -> its variant: every strategy by its name (its preset as it is), then the
    labelled variants above."""
    table = {name: Variant(name, {"strategy": name}) for name in registry.names()}
    for variant in VARIANTS:
        table[variant.label] = variant
    return table


def canonical(label: str) -> str:
    """``label`` as it is written now: an old label (``ALIASES``) becomes its current one."""
    return ALIASES.get(label, label)


def known(label: str) -> bool:
    """Whether ``options`` takes ``label``: a label, an old label or a strategy's name."""
    return canonical(label) in variants()


def options(label: str, ranks_per_node: Optional[int] = None) -> dict[str, Any]:
    """The ``comm.*`` options ``label`` stands for: ``strategy`` first, then its variant's keys (the
    layout's ``ranks_per_node`` where the variant takes it from the layout). Raises ValueError."""
    found = variants().get(canonical(label))
    if found is None:
        raise ValueError(f"unknown strategy label {label!r}: known are {', '.join(variants())}")
    chosen = dict(found.options)
    if "ranks_per_node" in found.layout_keys:
        chosen["ranks_per_node"] = ranks_per_node
    return chosen


def options_of(labels: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """Label -> ``comm.*`` options for each of ``labels``, in their order."""
    return {label: options(label) for label in labels}


def with_every_strategy(labels: tuple[str, ...]) -> tuple[str, ...]:
    """``labels``, then every registered strategy none of them is a variant of: a strategy added
    (a preset and its module) is in a tool's list without editing the tool."""
    covered = {options(label)["strategy"] for label in labels}
    return (*labels, *(name for name in registry.names() if name not in covered))

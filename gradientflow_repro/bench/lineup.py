"""Which strategies the benchmarks run, in their tables' order.

``CLUSTER_BENCH`` (``bench/cluster.py``: communication alone on the emulated cluster) and
``COMM_BENCH`` (``bench/comm.py``: real gradient shapes on loopback) name their labels (defined in
``variants.py``), then take every registered strategy none of them covers (``variants.
with_every_strategy``): a strategy added as a preset and its module is benchmarked without an edit here.
"""

from __future__ import annotations

from gradientflow_repro import variants
from gradientflow_repro.variants import CSC_SWEEP, DDP_STYLE, FLAT, HIERARCHICAL, POOL_SWEEP, RING_FP16


def cluster_bench() -> tuple[str, ...]:
    """The cluster benchmark's labels."""
    return variants.with_every_strategy(("allreduce", "ddp", "ring", RING_FP16, "lazy", DDP_STYLE, "csc", FLAT,
                                         HIERARCHICAL, "ddp-fp16", "powersgd"))


def comm_bench() -> tuple[str, ...]:
    """The comm benchmark's labels: the baselines, the pool's and CSC's sweeps, the peers."""
    return variants.with_every_strategy(("allreduce", "ddp", *(v.label for v in POOL_SWEEP),
                                         *(v.label for v in CSC_SWEEP), "ddp-fp16", "powersgd"))

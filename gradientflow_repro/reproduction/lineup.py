"""Which strategies ``make reproduce`` and ``make convergence`` train, in the report's order.

``LADDER``: the paper's ablation, one technique per rung (the scaling model checks it);
``SPARSE_VARIANTS``: trained beside it for CSC's convergence cost (not rungs of the speed ladder);
``PEERS``: what researchers would use instead (PyTorch's own fp16 and PowerSGD hooks) and the
paper's stack as published; ``COMPARED``: all three. Each is label -> ``comm.*`` options; the labels
are defined in ``variants.py``.
"""

from __future__ import annotations

from gradientflow_repro import variants
from gradientflow_repro.variants import LAZY_FP16, LOW_DENSITY, MOMENTUM_CORRECTED, RING_FP16

LADDER_LABELS = ("allreduce", "ddp", "ring", RING_FP16, LAZY_FP16, "gradientflow")
SPARSE_VARIANT_LABELS = (LOW_DENSITY, MOMENTUM_CORRECTED)
PEER_LABELS = ("gradientflow-paper", "ddp-fp16", "powersgd")

LADDER = variants.options_of(LADDER_LABELS)
SPARSE_VARIANTS = variants.options_of(SPARSE_VARIANT_LABELS)
PEERS = variants.options_of(PEER_LABELS)
COMPARED = {**LADDER, **SPARSE_VARIANTS, **PEERS}

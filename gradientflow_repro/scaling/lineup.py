"""Which strategies ``results/scaling.md`` projects by default, in its order (labels: ``variants.py``)."""

from __future__ import annotations

from gradientflow_repro.variants import FLAT, LAZY_FP16, LAZY_TWO_LEVEL, RING_FP16

PROJECTION = ("allreduce", "ddp", "ring", RING_FP16, LAZY_FP16, LAZY_TWO_LEVEL, "gradientflow", FLAT,
              "ddp-fp16", "powersgd")

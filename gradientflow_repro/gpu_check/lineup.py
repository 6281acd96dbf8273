"""Which strategies the GPU check runs on CUDA tensors (labels: ``variants.py``)."""

from __future__ import annotations

from gradientflow_repro.variants import LAZY_FP16

GPU_CHECK = ("allreduce", "ddp", "lazy", LAZY_FP16, "csc", "gradientflow")

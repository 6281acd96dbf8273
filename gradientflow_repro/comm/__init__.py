"""Gradient communication: one file per technique, all behind ``Communicator`` (base.py).

    knobs.py         the strategies: five knobs, the presets of configs/comm/, resolution (torch-free)
    allreduce.py     per-tensor allreduce after backward (the naive baseline)
    ddp.py           PyTorch DistributedDataParallel
    hooks.py         DDP communication hooks: our ring / fp16 wire (sum_hook) and CSC (csc_hook) in any DDP program
    ring.py          ring allreduce from send/recv
    recursive_doubling.py  small messages in log2(N) steps (norms, scales, agreements)
    hierarchical.py  intra-node reduce, inter-node ring, intra-node broadcast
    compression.py   fp16 wire format
    lazy.py          memory pool, fusion threshold, overlap with backward
    pool.py          the pool's packing rule and CSC's part layout (torch-free, shared with the model)
    csc.py           coarse-grained sparse communication
    factory.py       a resolved configuration -> the communicator

The names below load on first use, so ``gradientflow_repro.comm.knobs`` can be imported without
torch (by the config check and the analytic model).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {"CommStats": "base", "Communicator": "base", "build_communicator": "factory",
            "resolve": "knobs", "presets": "knobs", "CommConfig": "knobs", "LADDER": "knobs",
            "SumHookState": "hooks", "sum_hook": "hooks", "CSCHookState": "hooks", "csc_hook": "hooks"}
__all__ = [*_EXPORTS, "STRATEGIES"]


def __getattr__(name: str) -> Any:
    if name == "STRATEGIES":  # strategy name -> the knobs its preset sets
        return importlib.import_module(f"{__name__}.knobs").presets()
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

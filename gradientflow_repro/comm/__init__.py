"""Gradient communication: one file per technique, all behind ``Communicator`` (base.py).

    registry.py      a strategy's name -> its preset (configs/comm/) and its sparsifier: keys, builder (torch-free)
    knobs.py         the shared comm.* keys (five knobs and sizes) and how a message is summed (torch-free)
    plan.py          a configuration resolved once into an immutable Plan, which the factory builds (torch-free)
    allreduce.py     per-tensor allreduce after backward (the naive baseline)
    ddp.py           PyTorch DistributedDataParallel
    hooks.py         DDP communication hooks: our ring / fp16 wire (sum_hook) and CSC (csc_hook) in any DDP program
    ring.py          ring allreduce from send/recv
    recursive_doubling.py  small messages in log2(N) steps (norms, scales, agreements)
    hierarchical.py  intra-node reduce, inter-node ring, intra-node broadcast
    compression.py   fp16 wire format
    lazy.py          memory pool, fusion threshold, overlap with backward
    pool.py          the pool's packing rule and CSC's part layout (torch-free, shared with the model)
    powersgd.py      PyTorch's PowerSGD hook as a sparsifier: its key, builder and pricing (torch-free)
    csc/             coarse-grained sparse communication: the algorithm and its keys (__init__.py), chunk selection
                     and release cap (selection.py), momentum correction (momentum.py), LARS's trust
                     ratio and its noise (trust.py), per-bucket state (state.py), CSCCommunicator
    factory.py       a Plan -> the communicator, in one pass

A strategy is its preset (configs/comm/NAME.yaml) and, where it brings code of its own, one module
that declares its sparsifier (docs/extending.md: adding one).

The names below load on first use, so ``gradientflow_repro.comm.knobs``, ``.plan`` and ``.registry``
can be imported without torch (by the config check and the analytic model).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {"CommStats": "base", "Communicator": "base", "build_communicator": "factory",
            "resolve": "plan", "Plan": "plan", "presets": "knobs", "CommConfig": "knobs",
            "SumHookState": "hooks", "sum_hook": "hooks", "CSCHookState": "hooks", "csc_hook": "hooks"}
__all__ = [*_EXPORTS, "STRATEGIES"]


def __getattr__(name: str) -> Any:
    if name == "STRATEGIES":  # strategy name -> the knobs its preset sets
        return importlib.import_module(f"{__name__}.knobs").presets()
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

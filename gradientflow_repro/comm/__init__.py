"""Gradient communication: one file per technique, all behind ``Communicator`` (base.py).

    registry.py      the strategies: every one's name, labels, lists, sparsifier and pricing rule (torch-free)
    knobs.py         five knobs, the presets of configs/comm/, resolution against the registry (torch-free)
    allreduce.py     per-tensor allreduce after backward (the naive baseline)
    ddp.py           PyTorch DistributedDataParallel
    hooks.py         DDP communication hooks: our ring / fp16 wire (sum_hook) and CSC (csc_hook) in any DDP program
    ring.py          ring allreduce from send/recv
    recursive_doubling.py  small messages in log2(N) steps (norms, scales, agreements)
    hierarchical.py  intra-node reduce, inter-node ring, intra-node broadcast
    compression.py   fp16 wire format
    lazy.py          memory pool, fusion threshold, overlap with backward
    pool.py          the pool's packing rule and CSC's part layout (torch-free, shared with the model)
    csc/             coarse-grained sparse communication: the algorithm (__init__.py), chunk selection
                     and release cap (selection.py), momentum correction (momentum.py), LARS's trust
                     ratio and its noise (trust.py), per-bucket state (state.py), CSCCommunicator
    factory.py       a resolved configuration -> the communicator

A strategy is its preset (configs/comm/NAME.yaml) and its entry in ``registry.py``, which every
reader of strategy names, labels and lists goes through (docs/extending.md: adding one).

The names below load on first use, so ``gradientflow_repro.comm.knobs`` and ``.registry`` can be
imported without torch (by the config check and the analytic model).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {"CommStats": "base", "Communicator": "base", "build_communicator": "factory",
            "resolve": "knobs", "presets": "knobs", "CommConfig": "knobs", "LADDER": "knobs",
            "register": "registry",
            "SumHookState": "hooks", "sum_hook": "hooks", "CSCHookState": "hooks", "csc_hook": "hooks"}
__all__ = [*_EXPORTS, "STRATEGIES"]


def __getattr__(name: str) -> Any:
    if name == "STRATEGIES":  # strategy name -> the knobs its preset sets
        return importlib.import_module(f"{__name__}.knobs").presets()
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

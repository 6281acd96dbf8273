"""Gradient communication: one file per technique, all behind ``Communicator`` (base.py).

    allreduce.py     per-tensor allreduce after backward (the naive baseline)
    ddp.py           PyTorch DistributedDataParallel
    ring.py          ring allreduce from send/recv
    hierarchical.py  intra-node reduce, inter-node ring, intra-node broadcast
    compression.py   fp16 wire format
    lazy.py          memory pool, fusion threshold, overlap with backward
    csc.py           coarse-grained sparse communication
    factory.py       strategies by name: presets of independent knobs
"""

from gradientflow_repro.comm.base import CommStats, Communicator
from gradientflow_repro.comm.factory import STRATEGIES, build_communicator, resolve

__all__ = ["STRATEGIES", "CommStats", "Communicator", "build_communicator", "resolve"]

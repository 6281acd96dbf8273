"""Gradient communication: one file per technique, all behind ``Communicator`` (see base.py)."""

from gradientflow_repro.comm import allreduce, ddp  # noqa: F401  (registers the strategies)
from gradientflow_repro.comm.base import STRATEGIES, CommStats, Communicator, build_communicator

__all__ = ["STRATEGIES", "CommStats", "Communicator", "build_communicator"]

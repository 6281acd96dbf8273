"""Test-only hooks: how the test suite runs the check on CPUs and sees its verdicts fail.

Two environment variables, never set outside tests; the report's header names them whenever they
are set, and bad values are refused with the other options (exit status 2).

- ``GRADIENTFLOW_GPU_CHECK_TEST_DEVICE=cpu`` runs the items that have a CPU stand-in
  (``nccl_1rank``, ``nccl_2gpu``, ``comm_gloo_cuda`` on gloo with CPU tensors, ``throughput`` at
  toy sizes) instead of skipping them, with ``TEST_LIMIT_SCALE`` times the nominal limits and the
  budget (those are a GPU machine's; a shared CPU runs the stand-ins slower).
- ``GRADIENTFLOW_GPU_CHECK_TEST_FAULT=wrong_sum`` adds one to an element of every sum under test
  (never to its reference); ``=stale_pool`` makes the lazy and CSC communicators send, after their
  first step, that first step's pool contents again (the ranks still agree with each other, so only
  a comparison with a reference can tell). Either must turn the items that check it to FAIL.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch

TEST_DEVICE_ENV = "GRADIENTFLOW_GPU_CHECK_TEST_DEVICE"
TEST_FAULT_ENV = "GRADIENTFLOW_GPU_CHECK_TEST_FAULT"
TEST_DEVICES = ("cpu",)
TEST_FAULTS = ("wrong_sum", "stale_pool")
TEST_LIMIT_SCALE = 4.0


def test_device() -> Optional[str]:
    """``cpu`` when a test runs the collective items on gloo with CPU tensors, else None."""
    return os.environ.get(TEST_DEVICE_ENV) or None


def limit_scale() -> float:
    """What the items' nominal limits are multiplied by: ``TEST_LIMIT_SCALE`` under the test device, else 1."""
    return TEST_LIMIT_SCALE if test_device() == "cpu" else 1.0


def injected(fault: str) -> bool:
    """Whether a test asked to break ``fault`` (one of TEST_FAULTS) to see the check fail."""
    return fault in os.environ.get(TEST_FAULT_ENV, "").split(",")


def test_hooks_problem() -> Optional[str]:
    """Why the test-only environment variables are not usable as set, or None."""
    device = os.environ.get(TEST_DEVICE_ENV)
    if device and device not in TEST_DEVICES:
        return f"{TEST_DEVICE_ENV}={device!r}: must be one of {', '.join(TEST_DEVICES)} (or unset)"
    faults = [f for f in os.environ.get(TEST_FAULT_ENV, "").split(",") if f]
    unknown = [f for f in faults if f not in TEST_FAULTS]
    if unknown:
        return f"{TEST_FAULT_ENV}: unknown fault(s) {unknown}; known: {', '.join(TEST_FAULTS)}"
    return None


def test_hooks_set() -> str:
    """The test-only variables that are set, for the report's header ('' when none)."""
    return ", ".join(f"{name}={os.environ[name]}" for name in (TEST_DEVICE_ENV, TEST_FAULT_ENV)
                     if os.environ.get(name))


def break_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Under the ``wrong_sum`` fault: one element of a sum under test off by one (in place)."""
    if injected("wrong_sum") and tensor.numel():
        tensor.view(-1)[0] += 1
    return tensor


def stale_pool(comm: Any) -> None:
    """Under the ``stale_pool`` fault: ``comm`` (lazy or CSC) sends, from its second step on, what
    its pool held when it first sent each part: every rank sends stale data alike, so the ranks
    agree with each other and only a comparison with a reference can tell."""
    if not injected("stale_pool") or not hasattr(comm, "reduce_bucket"):
        return
    first: dict[int, torch.Tensor] = {}
    reduce_bucket = comm.reduce_bucket

    def stale(bucket: Any) -> None:
        saved = first.setdefault(id(bucket), bucket.flat.detach().clone())
        bucket.flat.copy_(saved)
        reduce_bucket(bucket)

    comm.reduce_bucket = stale

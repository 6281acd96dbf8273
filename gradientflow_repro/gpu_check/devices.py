"""Which device an item runs on, and timing on it.

An item needing GPUs is SKIP without them (``gpu_gate``); the collective items run on gloo with
CPU tensors instead under the test device (``hooks``), which is how the suite checks them.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Optional

import torch

from gradientflow_repro.gpu_check.hooks import test_device
from gradientflow_repro.gpu_check.results import NO_CUDA, Skip


def gpu_gate(gpus: int, on_test_cpu: bool = False) -> Optional[str]:
    """Why an item needing ``gpus`` devices cannot run here, or None."""
    if on_test_cpu and test_device() == "cpu":
        return None
    if gpus and not torch.cuda.is_available():
        return NO_CUDA
    if gpus > 1 and torch.cuda.device_count() < gpus:
        return f"needs >= {gpus} GPUs (one NCCL rank per GPU); this machine has {torch.cuda.device_count()}"
    return None


def cuda_device(index: int = 0) -> torch.device:
    """``cuda:index``, made the current device; Skip naming why where there is none."""
    reason = gpu_gate(index + 1)
    if reason:
        raise Skip(reason)
    device = torch.device("cuda", index)
    torch.cuda.set_device(device)
    return device


def collective_device(index: int = 0) -> torch.device:
    """The device of a collective item: ``cuda:index`` (Skip without it), or the CPU when a test runs
    the item on gloo (GRADIENTFLOW_GPU_CHECK_TEST_DEVICE=cpu)."""
    return torch.device("cpu") if test_device() == "cpu" else cuda_device(index)


def backend_for(device: torch.device) -> str:
    """The process group backend for collectives on ``device``."""
    return "nccl" if device.type == "cuda" else "gloo"


def median_us(call: Callable[[], Any], device: torch.device, warmup: int = 5, repeats: int = 50) -> float:
    """Median wall time of ``call`` in microseconds, each call followed by a device synchronisation."""
    for _ in range(warmup):
        call()
    synchronize(device)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        synchronize(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work (nothing to wait for on the CPU), so that a time is the work's."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)

"""What the machine has: torch, CUDA, NCCL and driver versions, the GPUs and their compute
capability (each must be in torch's arch list), DALI and the optional packages; and which
processes hold a context on each GPU.

torch answers what it was built with and sees; the driver's version and the GPUs the driver sees
come from NVML (``pynvml``) where it is installed, else from ``nvidia-smi``. A machine whose
driver sees GPUs that torch does not (a CPU-only build, a driver too old) is a FAIL of the
``environment`` item, which runs in the check's own process.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import platform
import shutil
from typing import Any, Optional

import torch

from gradientflow_repro.gpu_check.processes import run_command
from gradientflow_repro.gpu_check.results import NO_CUDA, Reporter, need


def nvidia_smi(*query: str) -> Optional[list[list[str]]]:
    """Rows of an ``nvidia-smi --query-...=... --format=csv,noheader`` call, or None."""
    if shutil.which("nvidia-smi") is None:
        return None
    status, output, _ = run_command(["nvidia-smi", *query, "--format=csv,noheader"], 30)
    if status != 0:
        return None
    return [[cell.strip() for cell in line.split(",")] for line in output.splitlines() if line.strip()]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def gpu_processes() -> Optional[dict[str, set[int]]]:
    """PIDs holding a context on each GPU, by normalised UUID in NVML's order (pynvml, else
    nvidia-smi); None when neither can tell."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            found = {}
            for index in range(pynvml.nvmlDeviceGetCount()):
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                found[_uuid(_text(pynvml.nvmlDeviceGetUUID(handle)))] = {
                    p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)}
            return found
        finally:
            pynvml.nvmlShutdown()
    except ImportError:
        pass
    gpus, apps = nvidia_smi("--query-gpu=uuid"), nvidia_smi("--query-compute-apps=gpu_uuid,pid")
    if gpus is None or apps is None:
        return None
    found = {_uuid(row[0]): set() for row in gpus}
    for gpu, pid in (row[:2] for row in apps if len(row) >= 2 and row[1].isdigit()):
        found.setdefault(_uuid(gpu), set()).add(int(pid))
    return found


def _uuid(text: str) -> str:
    text = text.strip().lower()
    return text.removeprefix("gpu-")


def cuda_uuid(index: int) -> Optional[str]:
    """GPU ``index``'s UUID as torch sees it (normalised as NVML's), or None."""
    with contextlib.suppress(Exception):
        return _uuid(str(torch.cuda.get_device_properties(index).uuid))
    return None


def _nccl_version() -> Optional[str]:
    with contextlib.suppress(Exception):
        version = torch.cuda.nccl.version()
        return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    return None


@functools.lru_cache(maxsize=None)
def gpu_environment() -> dict[str, Any]:
    """Versions and GPUs as torch, NVML (pynvml) or nvidia-smi see them: torch, cuda, nccl, python,
    driver (and driver_from: which tool said), gpus (torch's: name and sm_XY), arch_list (the SM
    architectures torch was built for) and smi_gpus (how many the driver sees). Cached: it does not
    change while the check runs, and the header and the environment item both read it."""
    facts: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda, "nccl": _nccl_version(),
                             "driver": None, "driver_from": None, "gpus": [], "smi_gpus": None,
                             "python": platform.python_version(), "arch_list": []}
    if torch.cuda.is_available():
        facts["arch_list"] = torch.cuda.get_arch_list()
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            facts["gpus"].append({"name": props.name, "sm": f"sm_{props.major}{props.minor}"})
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            facts["driver"], facts["driver_from"] = _text(pynvml.nvmlSystemGetDriverVersion()), "pynvml"
            facts["smi_gpus"] = pynvml.nvmlDeviceGetCount()
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - not installed, or no driver: nvidia-smi next
        rows = nvidia_smi("--query-gpu=driver_version,name,compute_cap")
        if rows:
            facts["driver"], facts["driver_from"], facts["smi_gpus"] = rows[0][0], "nvidia-smi", len(rows)
    return facts


def gpu_summary(facts: dict[str, Any]) -> str:
    """The GPUs of ``gpu_environment()`` in one phrase, for the report's header."""
    if not facts["gpus"]:
        return f"none ({NO_CUDA})"
    return f"{len(facts['gpus'])}: " + ", ".join(f"{g['name']} ({g['sm']})" for g in facts["gpus"])


def versions_summary(facts: dict[str, Any]) -> str:
    """torch, CUDA, NCCL and driver versions in one phrase."""
    driver = f"{facts['driver']} ({facts['driver_from']})" if facts["driver"] else "unknown (no pynvml, no nvidia-smi)"
    return (f"torch {facts['torch']}, CUDA {facts['cuda'] or 'none (CPU-only build)'}, "
            f"NCCL {facts['nccl'] or 'none'}, driver {driver}")


def _distribution_version(*names: str) -> Optional[str]:
    for name in names:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(name)
    return None


def check_environment(report: Reporter) -> None:
    """The item ``environment``: FAIL where a GPU's architecture is not in torch's build or the
    driver sees GPUs that torch does not; DALI's version and the optional packages' beside it."""
    facts = gpu_environment()
    with report.part():
        problems = [f"{g['name']}: {g['sm']} is not in torch's arch list {facts['arch_list']}"
                    for g in facts["gpus"] if g["sm"] not in facts["arch_list"]]
        if not facts["gpus"] and facts["smi_gpus"]:
            problems.append(f"the driver sees {facts['smi_gpus']} GPU(s) but torch.cuda.is_available() is "
                            f"False (a CPU-only torch build, or a driver too old for CUDA {facts['cuda']}?)")
        gpus = ", ".join(f"{g['name']} ({g['sm']}, {'in' if g['sm'] in facts['arch_list'] else 'NOT in'} "
                         f"torch's arch list)" for g in facts["gpus"]) or NO_CUDA
        report.add("FAIL" if problems else "PASS",
                   f"{versions_summary(facts)}, Python {facts['python']}, {len(facts['gpus'])} GPU(s): {gpus}"
                   + ("; " + "; ".join(problems) if problems else ""))
    with report.part("dali"):
        need("nvidia.dali")
        import nvidia.dali

        report.add("PASS", f"DALI {nvidia.dali.__version__}", "dali")
    with report.part("packages"):
        found = {name: _distribution_version(*dists) for name, dists in (
            ("torchvision", ["torchvision"]), ("timm", ["timm"]), ("hydra-core", ["hydra-core"]),
            ("omegaconf", ["omegaconf"]), ("wandb", ["wandb"]), ("matplotlib", ["matplotlib"]),
            ("scikit-learn", ["scikit-learn"]), ("pynvml", ["nvidia-ml-py", "pynvml"]))}
        report.add("PASS", ", ".join(f"{name} {version or 'absent'}" for name, version in found.items()),
                   "packages")

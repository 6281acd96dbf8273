"""The GPU check: one prepared script that says whether this project's CUDA path works on a machine.

The test suite runs on CPUs with gloo; what only a GPU machine can show is collected here, to run
in one go (under 8 minutes, however many GPUs) as ``make gpu-check``, which installs nothing: it
runs ``python -m gradientflow_repro.gpu_check`` with the project's venv where there is one, else
with the machine's ``python3`` (``PYTHON=...`` names another). On a bare machine with nothing but
torch, from the repository root: ``python3 -m gradientflow_repro.gpu_check [--out FILE] [--only
ITEM ...] [--budget-s S] [--strict]``. The items, in the order they run (the multi-GPU one first,
so that a check cut short by its budget has run NCCL across GPUs):

    environment     torch, CUDA, NCCL and driver versions, GPUs and their compute capability (each
                    must be in torch's arch list), DALI and the optional packages
    nccl_2gpu       one NCCL rank per GPU on two GPUs: our ring and hierarchical sums against
                    ``dist.all_reduce``; the trainer's collective helpers (agree_max,
                    all_reduce_scalars, ranks_that_differ, barrier) on rank-dependent values; a few
                    lazy-allreduce steps whose gradients must equal ``dist.all_reduce`` of the
                    reference model's gradients over the ranks; a rank on GPU 1 must hold no CUDA
                    context on GPU 0
    nccl_1rank      an NCCL process group of one rank: every collective the trainer's helpers
                    send (all_reduce SUM/MAX/MIN, broadcast, all_gather, reduce, ...) really sent
                    through NCCL on random data, each result checked (the out-of-place ones show
                    that NCCL wrote their output), us per call. (The helpers themselves return
                    before any collective at world size 1: nccl_2gpu sends theirs.)
    comm_gloo_cuda  every communicator (allreduce, ddp, lazy, csc, gradientflow) on CUDA tensors in
                    two gloo ranks sharing GPU 0, against the mean of the ranks' own gradients; an
                    inf on one rank must reach both; the full stack under timm's Lars against the
                    same run on the CPU (the test suite runs this item on CPU tensors)
    throughput      images/s of the project's fp16 step (``precision.Precision``: autocast, loss
                    scale, the agreed finiteness check) on AlexNet-BN, against the paper's 3,297
                    images/s per GPU: PASS only above it; ResNet-50's figure beside it; host
                    synchronisations per step of the trainer's own step (at most one)
    trainer_fp16    the trainer end to end through torchrun on CUDA with fp16 (allreduce, lazy,
                    gradientflow), then resumed from its checkpoint
    dali            DALI's GPU (nvJPEG, ``mixed``) and CPU pipelines over one epoch of the digits

Each item prints lines ``PASS|FAIL|SKIP  <item>: <figures or reason>``; a SKIP names what was
missing (a GPU, a package, the budget). All lines and a header (date, host, GPUs, versions,
commit, command) go to ``results/gpu_check.md`` (``--out``), rewritten after every item so that a
check cut short still leaves its file, and every child's full output goes to the ``.log`` beside
it. Exit status: 1 if any line is FAIL (with ``--strict`` also if any is SKIP), else 0; 2 for bad
options (an ``--out`` that is a directory or cannot be written, an unknown item), refused in one
line before any item runs.

Time: every item has a nominal limit; an item's limit is its share of what is left of the budget
(default 480 s), in proportion to the nominal limits of the items still to run here, and never
more than its nominal limit, so the whole check ends within the budget whatever the GPU count.

What a bare machine needs. Only the standard library, torch and ``cluster.world.free_port``
(standard library only) are imported at module level; the project's other modules and optional
packages are imported inside the items that use them, and a missing one makes its item (or part)
SKIP, naming every missing package. ``environment``, ``nccl_1rank`` (the collectives and the
trainer's helpers) and the AlexNet-BN figure (the project's fp16 step: ``precision.py`` imports
neither Hydra nor PyYAML) need only torch, plus numpy for torch's own object collectives
(``all_gather_object``). What builds a communicator (``nccl_2gpu``, ``comm_gloo_cuda``) also needs
PyYAML (the presets of ``configs/comm/``) and timm (the Lars optimizer), which a machine with timm
has (timm brings PyYAML, numpy and torchvision; ResNet-50 needs torchvision).

The trainer (``trainer_fp16`` and the host-synchronisation count) needs Hydra and what the trainer
imports with ``logger=jsonl data=synthetic``, which is neither wandb nor DALI: hydra-core,
omegaconf, antlr4-python3-runtime (4.9.x), PyYAML, timm, mlperf-logging (only its ``mllog``
module: install it with ``--no-deps``, which leaves out pandas and scipy) and matplotlib (the
trainer draws its top-1 plot when a run ends, ``tracking.plot_top1``; not a small wheel: it brings
compiled dependencies of its own). Offline, bring the four small wheels (pure Python, under 1 MB
together; ``pip wheel`` builds one where only a source archive is published) and install them
without an index::

    pip wheel --no-deps -w wheels hydra-core==1.3.8 omegaconf==2.3.1 \
        antlr4-python3-runtime==4.9.3 mlperf-logging==4.1.68      # on a machine with internet
    pip install --no-index --no-deps wheels/*.whl               # on the GPU machine

How it stays robust where parts are missing or broken. The environment item runs in this process;
every other item runs in a fresh Python process with its own time limit, so a CUDA context, an
NCCL communicator or a hang in one item cannot touch the next: a process still running at its
limit is killed with its whole process group and the item gets a FAIL "hung > N s". An exception
inside an item is a FAIL line for that item (or the part of it that raised), never a crash of the
script.

How the check itself is tested (on CPUs, ``tests/test_gpu_check.py``): two environment variables,
for tests only and named in the report's header whenever they are set.
``GRADIENTFLOW_GPU_CHECK_TEST_DEVICE=cpu`` runs the collective items (``nccl_1rank``, ``nccl_2gpu``,
``comm_gloo_cuda``) on gloo with CPU tensors instead of skipping them.
``GRADIENTFLOW_GPU_CHECK_TEST_FAULT=wrong_sum`` adds one to an element of every sum under test
(never to its reference); ``=stale_pool`` makes the lazy and CSC communicators send, after their
first step, that first step's pool contents again (the ranks still agree with each other). Either
must turn the items that check it to FAIL.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import dataclasses
import datetime
import functools
import importlib
import importlib.metadata
import json
import math
import os
import platform
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch

from gradientflow_repro.cluster.world import free_port

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "results" / "gpu_check.md"
MARK = "@@gpu_check "  # prefix of a result line on a child process's output
REPORTED_EXIT = 3  # a spawned rank that reported its own failure exits with this
NO_CUDA = "no CUDA device"
PACKAGES = {"hydra": "hydra-core", "omegaconf": "omegaconf", "nvidia.dali": "DALI (nvidia-dali-cuda*)",
            "nvidia": "DALI (nvidia-dali-cuda*)", "torchvision": "torchvision", "timm": "timm",
            "matplotlib": "matplotlib", "sklearn": "scikit-learn", "PIL": "pillow", "pynvml": "nvidia-ml-py",
            "mlperf_logging": "mlperf-logging", "antlr4": "antlr4-python3-runtime", "yaml": "PyYAML"}
# What the trainer imports with logger=jsonl data=synthetic (neither wandb nor DALI)
TRAINER_MODULES = ("hydra", "omegaconf", "antlr4", "yaml", "timm", "mlperf_logging", "matplotlib")
# The paper's single-GPU throughput of AlexNet-BN in fp16: 1,281,167 images x 95 epochs in 90 s on
# 410.2 GPU-equivalents (its own figures): the bar this machine's fp16 step has to beat.
PAPER_ALEXNET_IMAGES_PER_S = 3297.0

# Test-only hooks (see the module docstring): never set outside tests; the report names them.
TEST_DEVICE_ENV = "GRADIENTFLOW_GPU_CHECK_TEST_DEVICE"
TEST_FAULT_ENV = "GRADIENTFLOW_GPU_CHECK_TEST_FAULT"
TEST_DEVICES = ("cpu",)
TEST_FAULTS = ("wrong_sum", "stale_pool")


def test_device() -> Optional[str]:
    """``cpu`` when a test runs the collective items on gloo with CPU tensors, else None."""
    return os.environ.get(TEST_DEVICE_ENV) or None


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


# ---------------------------------------------------------------------------------------------
# Results, items and how they run


@dataclass(frozen=True)
class Result:
    status: str  # PASS | FAIL | SKIP
    item: str  # "item" or "item/part"
    detail: str  # figures or the reason

    def line(self) -> str:
        return f"{self.status}  {self.item}: {self.detail}"


class Skip(Exception):
    """Raised inside an item (or a part of one) that cannot run here; the message says why."""


def describe(error: BaseException) -> str:
    """One line for an exception (the last line of a traceback carried in its message)."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    if len(lines) > 1 and any(line.startswith("Traceback") for line in lines):
        return lines[-1][:400]
    return f"{type(error).__name__}: {' '.join(lines)[:400]}"


class Reporter:
    """An item's result lines, each handed to ``emit`` as soon as it is made."""

    def __init__(self, item: str, emit: Callable[[Result], None]) -> None:
        self.item, self.emit = item, emit
        self.results: list[Result] = []

    def add(self, status: str, detail: str, part: Optional[str] = None) -> None:
        self.add_result(Result(status, f"{self.item}/{part}" if part else self.item, detail))

    def add_result(self, result: Result) -> None:
        """A line made elsewhere (by a spawned rank), under the item name it carries."""
        self.results.append(result)
        self.emit(result)

    @contextlib.contextmanager
    def part(self, name: Optional[str] = None) -> Iterator[None]:
        """Run a block as one (sub-)item: Skip becomes a SKIP line, any other exception a FAIL."""
        try:
            yield
        except Skip as skip:
            self.add("SKIP", str(skip), name)
        except Exception as error:  # noqa: BLE001 - one item's failure must not stop the check
            traceback.print_exc()
            self.add("FAIL", describe(error), name)


@dataclass(frozen=True)
class Item:
    name: str
    check: Callable[[Reporter], None]
    timeout_s: float
    gpus: int  # CUDA devices it needs (0: runs anywhere, in this process)
    doc: str
    on_test_cpu: bool = False  # runs on gloo with CPU tensors under GRADIENTFLOW_GPU_CHECK_TEST_DEVICE=cpu


def gpu_gate(gpus: int, on_test_cpu: bool = False) -> Optional[str]:
    """Why an item needing ``gpus`` devices cannot run here, or None."""
    if on_test_cpu and test_device() == "cpu":
        return None
    if gpus and not torch.cuda.is_available():
        return NO_CUDA
    if gpus > 1 and torch.cuda.device_count() < gpus:
        return f"needs >= {gpus} GPUs (one NCCL rank per GPU); this machine has {torch.cuda.device_count()}"
    return None


def run_here(item: Item, emit: Callable[[Result], None] = lambda result: None) -> list[Result]:
    """Run an item in this process: its lines, with any exception turned into a FAIL line."""
    report = Reporter(item.name, emit)
    with report.part():
        item.check(report)
    if not report.results:
        report.add("FAIL", "the check reported nothing")
    return report.results


def stop_group(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """SIGTERM to the process group of ``proc`` (started with a session of its own), then SIGKILL."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace_s)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace_s)


def _child_env(extra_paths: list[str]) -> dict[str, str]:
    paths = [*extra_paths, os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p), "PYTHONUNBUFFERED": "1"}


CHILD_MAIN = "import sys; from gradientflow_repro.gpu_check import child_main; child_main(sys.argv[1:])"


def run_in_child(item: Item, emit: Callable[[Result], None] = lambda result: None,
                 log: Optional[Callable[[str], None]] = None) -> list[Result]:
    """Run an item in a fresh Python process with its own time limit; lines stream as they come.
    The child imports the item's function by module and name, so any importable function works."""
    module = sys.modules[item.check.__module__]
    name = module.__spec__.name if module.__name__ == "__main__" and module.__spec__ else module.__name__
    module_file = getattr(module, "__file__", None)
    extra = [str(REPO)] + ([str(Path(module_file).resolve().parents[name.count(".")])] if module_file else [])
    command = [sys.executable, "-c", CHILD_MAIN, f"{name}:{item.check.__qualname__}", item.name,
               str(item.timeout_s)]
    report = Reporter(item.name, emit)
    tail: collections.deque[str] = collections.deque(maxlen=30)
    proc = subprocess.Popen(command, cwd=REPO, env=_child_env(extra), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True)

    def read() -> None:
        for line in proc.stdout:
            if line.startswith(MARK):
                result = Result(**json.loads(line[len(MARK):]))
                report.results.append(result)
                emit(result)
            else:
                tail.append(line.rstrip())
                if log:
                    log(f"[{item.name}] {line.rstrip()}")

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        status: Optional[int] = proc.wait(timeout=item.timeout_s)
    except subprocess.TimeoutExpired:
        stop_group(proc)
        status = None
    except KeyboardInterrupt:  # the child has a session of its own: Ctrl-C does not reach it
        stop_group(proc)
        raise
    reader.join(timeout=10)
    last = next((line for line in reversed(tail) if line.strip()), "")
    if status is None:
        after = f" after its line {report.results[-1].item}" if report.results else ""
        report.add("FAIL", f"hung > {item.timeout_s:.0f} s{after}; killed")
    elif status != 0 and not any(r.status == "FAIL" for r in report.results):
        report.add("FAIL", f"its process exited with status {status}: {last[:300]}")
    elif not report.results:
        report.add("FAIL", f"its process reported nothing: {last[:300]}")
    return report.results


BUDGET_S = 480.0  # the whole check: 8 minutes even when items hang
_DEADLINE: Optional[float] = None  # in a child: when its parent will kill it (minus a margin)
_GROUPS: set[int] = set()  # process groups a child started (killed with it)


def time_left(default: float = 3600.0) -> float:
    return default if _DEADLINE is None else max(1.0, _DEADLINE - time.monotonic())


def _emit_marked(result: Result) -> None:
    print(MARK + json.dumps(asdict(result)), flush=True)


def child_main(argv: list[str]) -> None:
    """Entry of an item's child process: ``module:function item_name timeout_s``."""
    global _DEADLINE
    target, name, timeout_s = argv
    _DEADLINE = time.monotonic() + float(timeout_s) - 10.0

    def on_term(signum: int, frame: Any) -> None:
        for group in list(_GROUPS):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(group, signal.SIGKILL)
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    module, qualname = target.split(":")
    check = importlib.import_module(module)
    for attribute in qualname.split("."):
        check = getattr(check, attribute)
    run_here(Item(name, check, float(timeout_s), 0, ""), _emit_marked)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # results are out: no interpreter finalisation racing NCCL or gloo threads


def run_command(command: list[str], timeout_s: float, **popen: Any) -> tuple[Optional[int], str, float]:
    """Run a command in a process group of its own: (exit status or None if it hung, output, s)."""
    started = time.monotonic()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", start_new_session=True, **popen)
    _GROUPS.add(proc.pid)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
        return proc.returncode, output, time.monotonic() - started
    except subprocess.TimeoutExpired:
        stop_group(proc)
        try:
            output, _ = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            output = ""
        return None, output or "", time.monotonic() - started
    finally:
        _GROUPS.discard(proc.pid)


# ---------------------------------------------------------------------------------------------
# Small helpers shared by the items


def need(*modules: str) -> None:
    """Import each module, or Skip naming every package that is missing (not only the first). (A
    package that is there but fails to import for another reason is a FAIL: a broken installation.)"""
    missing = []
    for module in modules:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as error:
            missing.append(f"{PACKAGES.get(module, module)} (import {module}: {error})")
    if missing:
        raise Skip(f"needs {', '.join(missing)}")


@contextlib.contextmanager
def project_imports() -> Iterator[None]:
    """Around imports of the project's modules: a third-party module they need that is missing here
    makes the item SKIP, naming it (a missing project module stays an error)."""
    try:
        yield
    except ModuleNotFoundError as error:
        name = error.name or ""
        if not name or name.split(".")[0] == "gradientflow_repro":
            raise
        package = PACKAGES.get(name, PACKAGES.get(name.split(".")[0], name))
        raise Skip(f"needs {package}: the project's modules import {name}, which is missing") from None


def cuda_device(index: int = 0) -> torch.device:
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
    return "nccl" if device.type == "cuda" else "gloo"


def median_us(call: Callable[[], Any], device: torch.device, warmup: int = 5, repeats: int = 50) -> float:
    """Median wall time of ``call`` in microseconds, each call followed by a device synchronisation."""
    for _ in range(warmup):
        call()
    _synchronize(device)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        _synchronize(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


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
    with contextlib.suppress(Exception):
        return _uuid(str(torch.cuda.get_device_properties(index).uuid))
    return None


def git_commit() -> Optional[str]:
    try:
        def git(*args: str) -> str:
            return subprocess.run(["git", *args], capture_output=True, text=True, timeout=10,
                                  cwd=REPO).stdout.strip()
        commit = git("rev-parse", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return (f"{commit} (with uncommitted changes)" if dirty else commit) or None


# ---------------------------------------------------------------------------------------------
# 1. environment


def _nccl_version() -> Optional[str]:
    with contextlib.suppress(Exception):
        version = torch.cuda.nccl.version()
        return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    return None


@functools.lru_cache(maxsize=None)
def environment_facts() -> dict[str, Any]:
    """Versions and GPUs as torch, NVML (pynvml) or nvidia-smi see them."""
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
    if not facts["gpus"]:
        return f"none ({NO_CUDA})"
    return f"{len(facts['gpus'])}: " + ", ".join(f"{g['name']} ({g['sm']})" for g in facts["gpus"])


def versions_summary(facts: dict[str, Any]) -> str:
    driver = f"{facts['driver']} ({facts['driver_from']})" if facts["driver"] else "unknown (no pynvml, no nvidia-smi)"
    return (f"torch {facts['torch']}, CUDA {facts['cuda'] or 'none (CPU-only build)'}, "
            f"NCCL {facts['nccl'] or 'none'}, driver {driver}")


def _distribution_version(*names: str) -> Optional[str]:
    for name in names:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(name)
    return None


def check_environment(report: Reporter) -> None:
    facts = environment_facts()
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


# ---------------------------------------------------------------------------------------------
# 2. NCCL at world size 1: every collective the trainer's helpers send, really sent


def _one_rank_collectives(device: torch.device) -> dict[str, tuple[Callable[[], Any], Callable[[], list[str]]]]:
    """name -> (call, verify) for one rank's process group. Each call sends one collective on random
    data; verify (after one more call on fresh inputs) lists what is wrong with the result. At world
    size 1 the sum of one rank is its own value; the out-of-place collectives start from a filled
    output, so a collective that never reached the backend leaves it visibly wrong. The sums under
    test go through ``break_sum`` (the test-only wrong_sum fault)."""
    import torch.distributed as dist

    generator = torch.Generator().manual_seed(7)
    x_small = torch.randn(1, generator=generator, dtype=torch.float64).to(device)  # the helpers' scalars
    x_big = torch.randn(1 << 20, generator=generator).to(device)  # 4 MiB of fp32
    x_half = torch.randn(1 << 20, generator=generator).to(device, torch.float16)  # the fp16 wire
    state: dict[str, Any] = {}

    def fresh(name: str, value: torch.Tensor) -> torch.Tensor:
        state[name] = value.clone()
        return state[name]

    def reduce(name: str, value: torch.Tensor, **kw: Any) -> Callable[[], Any]:
        def call() -> None:
            dist.all_reduce(fresh(name, value), **kw)
            break_sum(state[name])
        return call

    def same(name: str, value: torch.Tensor) -> Callable[[], list[str]]:
        def verify() -> list[str]:
            got = state[name]
            if got.dtype != value.dtype or not torch.equal(got, value):
                error = (got.double() - value.double()).abs().max().item()
                return [f"result differs from the one rank's input by up to {error:.3g}"]
            return []
        return verify

    def out_of_place(name: str, value: torch.Tensor, send: Callable[[torch.Tensor, torch.Tensor], Any],
                     ) -> tuple[Callable[[], Any], Callable[[], list[str]]]:
        def call() -> None:
            state[name] = torch.full_like(value, float("nan"))
            send(state[name], value)
        return call, same(name, value)

    objects: list[Any] = []
    gathered_objects: list[Any] = [None]

    def broadcast_objects() -> None:
        objects[:] = [{"checkpoint": "step_000000020", "x": x_small.item()}]
        dist.broadcast_object_list(objects, src=0)

    def gather_objects() -> None:
        dist.all_gather_object(gathered_objects, ("rank 0", x_small.item()))

    calls: dict[str, tuple[Callable[[], Any], Callable[[], list[str]]]] = {
        "all_reduce SUM 8 B fp64": (reduce("sum8", x_small), same("sum8", x_small)),
        "all_reduce SUM 4 MiB fp32": (reduce("sum4m", x_big), same("sum4m", x_big)),
        "all_reduce SUM 2 MiB fp16": (reduce("sum16", x_half), same("sum16", x_half)),
        "all_reduce MAX 8 B fp64": (reduce("max8", x_small, op=dist.ReduceOp.MAX), same("max8", x_small)),
        "all_reduce MIN 8 B fp64": (reduce("min8", x_small, op=dist.ReduceOp.MIN), same("min8", x_small)),
        "broadcast 4 MiB": (lambda: dist.broadcast(fresh("bcast", x_big), src=0), same("bcast", x_big)),
        "reduce 4 MiB": (lambda: dist.reduce(fresh("reduce", x_big), dst=0), same("reduce", x_big)),
        "all_gather 4 MiB (out of place)": out_of_place(
            "gather", x_big, lambda out, value: dist.all_gather([out], value)),
        "all_gather_into_tensor 4 MiB (out of place)": out_of_place(
            "gather_t", x_big, lambda out, value: dist.all_gather_into_tensor(out, value)),
        "broadcast_object_list": (broadcast_objects, lambda: [] if objects == [
            {"checkpoint": "step_000000020", "x": x_small.item()}] else [f"got {objects!r:.80}"]),
        "all_gather_object": (gather_objects, lambda: [] if gathered_objects == [("rank 0", x_small.item())]
                              else [f"got {gathered_objects!r:.80}"]),
    }
    if device.type == "cuda":  # gloo has no reduce_scatter
        calls["reduce_scatter_tensor 4 MiB (out of place)"] = out_of_place(
            "scatter_t", x_big, lambda out, value: dist.reduce_scatter_tensor(out, value))
    return calls


def check_nccl_single_rank(report: Reporter) -> None:
    """A process group of one rank (NCCL on cuda:0; gloo on the CPU under the test device): every
    collective really sent, its result checked, and the trainer's helpers' answers at world size 1
    (where they return before any collective: their collectives are sent in nccl_2gpu)."""
    import torch.distributed as dist

    device = collective_device(0)
    backend = backend_for(device)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group(backend, rank=0, world_size=1, device_id=device if device.type == "cuda" else None,
                            timeout=datetime.timedelta(seconds=60))
    try:
        if dist.get_backend() != backend:
            raise RuntimeError(f"the process group's backend is {dist.get_backend()}, not {backend}")
        for name, (call, verify) in _one_rank_collectives(device).items():
            with report.part(name):
                micros = median_us(call, device, repeats=20)
                call()
                _synchronize(device)
                problems = verify()
                report.add("FAIL" if problems else "PASS",
                           f"{micros:.1f} us/call (median of 20, a fresh copy of the input included) through {backend}"
                           + (f": {'; '.join(problems)}" if problems else ", result checked"), name)
        with report.part("send/recv to self"):
            big = torch.randn(1 << 20, generator=torch.Generator().manual_seed(3)).to(device)
            received = torch.zeros_like(big)

            def self_send_recv() -> None:
                received.zero_()
                ops = [dist.P2POp(dist.isend, big, 0), dist.P2POp(dist.irecv, received, 0)]
                for work in dist.batch_isend_irecv(ops):
                    work.wait()

            try:
                self_send_recv()
            except Exception as error:  # noqa: BLE001 - torch or NCCL refusing is not a failure here
                raise Skip(f"refused by torch/{backend}: {describe(error)}") from None
            micros = median_us(self_send_recv, device, repeats=20)
            ok = bool(torch.equal(received, big))
            report.add("PASS" if ok else "FAIL", f"{micros:.1f} us per 4 MiB send+recv pair (median of 20)"
                       + ("" if ok else ": received data differ"), "send/recv to self")
        with report.part("the trainer's helpers at world size 1"):
            with project_imports():  # the collectives above need only torch; the helpers need the project's
                from gradientflow_repro.distributed import agree_max, all_reduce_scalars, barrier, ranks_that_differ
            flag = torch.ones((), device=device) * 3
            answers = {"agree_max": (agree_max([flag, 15.0], device), [3.0, 15.0]),
                       "all_reduce_scalars": (all_reduce_scalars([1.5, -2.0], device), [1.5, -2.0]),
                       "ranks_that_differ": (ranks_that_differ([flag], device), [])}
            barrier(device)
            wrong = [f"{name} gave {got}, not {want}" for name, (got, want) in answers.items() if got != want]
            report.add("FAIL" if wrong else "PASS", "; ".join(wrong) if wrong else
                       "agree_max, all_reduce_scalars, ranks_that_differ, barrier answer right (they send "
                       "nothing at world size 1: their collectives are in nccl_2gpu)",
                       "the trainer's helpers at world size 1")
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# 3. communicators on CUDA tensors: two gloo ranks sharing GPU 0

# (label, comm options). Presets whose algorithm is the ring run with algorithm=builtin (gloo has no
# send/recv of CUDA tensors), with pool parts of about 1 KiB so that the small model fills several.
POOL = {"algorithm": "builtin", "bucket_mb": 0.001}
CSC_KNOBS = {**POOL, "density": 0.1, "csc_warmup_epochs": 0.0, "chunk_size": 64}
COMM_CASES: list[tuple[str, dict[str, Any]]] = [
    ("allreduce", {"strategy": "allreduce"}),
    ("ddp", {"strategy": "ddp"}),
    ("lazy", {"strategy": "lazy", **POOL}),
    ("lazy+fp16 wire", {"strategy": "lazy", "wire": "fp16", **POOL}),
    ("csc", {"strategy": "csc", **CSC_KNOBS}),
    ("gradientflow", {"strategy": "gradientflow", **CSC_KNOBS}),
]
COMM_STEPS = 4
# The full stack under LARS on the device against the same run on the CPU (the path the test suite
# checks): momentum correction with LARS's ratio, the ratio's noise sketches (world > 1), a loss
# scale. Its invariant is not the plain mean (the velocity is what is summed), so the CPU run is the
# reference; rounding differs between devices, hence a tolerance.
# fp32 wire: the two devices' fp16 wires round differently (the device agrees on one scale, the host
# scales each message itself), and what the fp16 wire does is checked above; with fp32 the runs
# differ only by float rounding, so chunk choices do not flip and the tolerance can be tight.
PARITY_CASES: list[tuple[str, dict[str, Any]]] = [
    ("gradientflow+lars vs cpu", {"strategy": "gradientflow", **CSC_KNOBS, "wire": "fp32"})]
PARITY_STEPS = 6
PARITY_TOLERANCE = 1e-3  # of the largest update of any parameter over the steps


class SmallNet(torch.nn.Module):
    """Two weight matrices (sparsified by CSC) and 1-D tensors (always dense)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(37, 53)
        self.b = torch.nn.Linear(53, 11)
        self.norm = torch.nn.BatchNorm1d(11)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.b(torch.relu(self.a(x))))


def _gather_cpu(tensors: list[torch.Tensor], world: int) -> list[list[torch.Tensor]]:
    """Every rank's copy of ``tensors`` (one all_gather of their CPU copies): [rank][i]."""
    import torch.distributed as dist

    flat = torch.cat([t.detach().float().cpu().reshape(-1) for t in tensors])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    out = []
    for copy_ in gathered:
        pieces, offset = [], 0
        for tensor in tensors:
            pieces.append(copy_[offset:offset + tensor.numel()].view(tensor.shape))
            offset += tensor.numel()
        out.append(pieces)
    return out


def _residuals(comm: Any, params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    """CSC's per-rank residual of each parameter (zeros for dense strategies and dense tails).
    ``comm.residual`` is per pool part and covers its chunks; ``comm.buckets`` says where each
    parameter lies in the part (a parameter past the chunks is in the dense tail: no residual)."""
    by_param = {id(p): torch.zeros(p.shape) for p in params}
    for index, bucket in enumerate(getattr(comm, "buckets", [])):
        residual = getattr(comm, "residual", {}).get(index)
        if residual is None:
            continue
        flat = residual.detach().reshape(-1).cpu()
        for param, offset in zip(bucket.params, bucket.offsets):
            if offset + param.numel() <= flat.numel():
                by_param[id(param)] = flat[offset:offset + param.numel()].view(param.shape).clone()
    return [by_param[id(p)] for p in params]


def _same_message(comm: Any, params: list[torch.nn.Parameter]) -> list[list[int]]:
    """For each parameter, the parameters sent in the same message: its pool part, or itself."""
    index = {id(p): i for i, p in enumerate(params)}
    together = [[i] for i in range(len(params))]
    for bucket in getattr(comm, "buckets", []):
        members = [index[id(p)] for p in bucket.params]
        for i in members:
            together[i] = members
    return together


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _check_communicator(options: dict[str, Any], rank: int, world: int, device: torch.device) -> dict[str, Any]:
    """One communicator through COMM_STEPS steps and an overflow step; this rank's findings.

    Per step, with this rank's gradient g_r (from a plain copy of the model) and CSC residuals
    before (old_r) and after (new_r) the step: p.grad + mean_r(new_r) must equal mean_r(old_r + g_r)
    (dense strategies have no residual, so p.grad must be the mean gradient)."""
    import torch.distributed as dist

    from gradientflow_repro.comm.factory import build_communicator
    from gradientflow_repro.comm.knobs import resolve

    fp16 = resolve(options).wire == "fp16"
    torch.manual_seed(0)
    model = SmallNet().to(device)
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # momentum 0: CSC's velocity is the gradient
    comm = build_communicator(options, device)
    module = comm.attach(model, optimizer)
    stale_pool(comm)
    params = list(model.parameters())
    message = _same_message(comm, params)
    worst, step_ms, problems = 0.0, [], []
    for step in range(COMM_STEPS):
        x = torch.randn(16, 37, generator=torch.Generator().manual_seed(100 * rank + step)).to(device)
        reference.zero_grad(set_to_none=True)
        reference(x).pow(2).mean().backward()
        local = [p.grad for p in reference.parameters()]
        old = _residuals(comm, params)
        _synchronize(device)
        started = time.perf_counter()
        comm.begin_step(float(step), 1.0)
        module(x).pow(2).mean().backward()
        comm.synchronize()
        _synchronize(device)
        step_ms.append((time.perf_counter() - started) * 1e3)
        synced = [p.grad.detach().float().cpu() for p in params]
        comm.end_step(applied=True)
        model.zero_grad(set_to_none=True)
        ranks = _gather_cpu([*local, *old, *_residuals(comm, params)], world)
        n = len(params)
        accumulated = [torch.stack([r[n + i] + r[i] for r in ranks]) for i in range(n)]  # old_r + g_r
        # the fp16 wire scales each message by its largest value, and a pool part holds several
        # parameters: rounding is bounded relative to the largest value of the message
        largest = [max(accumulated[i].abs().max().item(), 1e-30) for i in range(n)]
        for i in range(n):
            expected = accumulated[i].mean(0)
            got = synced[i] + torch.stack([r[2 * n + i] for r in ranks]).mean(0)
            peak = max(largest[j] for j in message[i]) if fp16 else largest[i]
            error = (got - expected).abs().max().item()
            worst = max(worst, error / peak)
            ok = (error <= 2e-3 * peak) if fp16 else torch.allclose(got, expected, rtol=1e-6, atol=1e-6 * peak)
            if not ok:
                problems.append(f"step {step} parameter {i}: |error| {error:.3g} ({error / peak:.2g} of peak)")
    findings: dict[str, Any] = {"worst": worst, "ms": statistics.median(step_ms), "problems": problems[:3],
                                "density": comm.density_now}
    if hasattr(comm, "residual"):
        findings["held_back"] = any(r.abs().sum().item() > 0 for r in comm.residual.values())
        findings["selection"] = {int(k): v.tolist() for k, v in getattr(comm, "last_selection", {}).items()}
    # an inf in rank world-1's gradient must reach every rank (so the agreed overflow check skips)
    comm.begin_step(float(COMM_STEPS), 1.0)
    hook = None
    if rank == world - 1:
        first_row = torch.tensor([0], device=device)
        hook = model.a.weight.register_hook(lambda grad: grad.index_fill(0, first_row, float("inf")))
    x = torch.randn(16, 37, generator=torch.Generator().manual_seed(100 * rank + 99)).to(device)
    module(x).pow(2).mean().backward()
    if hook is not None:
        hook.remove()
    comm.synchronize()
    findings["inf_reached"] = not all(bool(torch.isfinite(p.grad).all()) for p in params)
    comm.end_step(applied=False)
    comm.close()
    dist.barrier()
    return findings


def _lars_run(options: dict[str, Any], rank: int, device: torch.device) -> dict[str, Any]:
    """PARITY_STEPS steps of SmallNet under timm's Lars (the trainer's parameter groups) through the
    communicator on ``device``, as the trainer steps (a loss scale on the device, divided out before
    the optimizer): the parameters before and after (on the CPU), the chunks chosen at each step,
    and whether the trust ratio's noise correction has running means in every pool part that has
    layers to correct."""
    from gradientflow_repro.comm.factory import build_communicator
    from gradientflow_repro.optim import Lars, parameter_groups

    torch.manual_seed(0)
    model = SmallNet().to(device)
    before = [p.detach().float().cpu().clone() for p in model.parameters()]
    optimizer = Lars(parameter_groups(model, 5e-4), lr=0.5, momentum=0.9, trust_coeff=0.06)
    comm = build_communicator(options, device)
    module = comm.attach(model, optimizer)
    scale = torch.tensor(1024.0, device=device)  # as fp16's loss scale: CSC keeps its state unscaled
    chosen = []
    for step in range(PARITY_STEPS):
        generator = torch.Generator().manual_seed(100 * rank + step)
        x, target = torch.randn(16, 37, generator=generator).to(device), torch.randn(16, 11, generator=generator)
        comm.begin_step(float(step), scale)
        (torch.nn.functional.mse_loss(module(x), target.to(device)) * scale).backward()
        comm.synchronize()
        for param in model.parameters():
            param.grad.div_(scale)
        optimizer.step()
        comm.end_step(applied=True)
        optimizer.zero_grad(set_to_none=True)
        chosen.append({int(k): v.tolist() for k, v in getattr(comm, "last_selection", {}).items()})
    _synchronize(device)
    noise = [part.noise for part in getattr(comm, "parts", []) if part.noise is not None]
    comm.close()
    return {"before": before, "after": [p.detach().float().cpu() for p in model.parameters()], "chosen": chosen,
            "noise_parts": len(noise), "noise_observed": bool(noise) and all(bool(n.abs().sum() > 0) for n in noise)}


def _check_parity(options: dict[str, Any], rank: int, world: int, device: torch.device) -> dict[str, Any]:
    """The run on ``device`` against the same run on the CPU, in the same process group, one after
    the other (each communicator's collectives in step on every rank); this rank's findings. The
    error is measured against the largest update of any parameter (a parameter whose gradient is
    nothing but rounding would make its own scale meaningless)."""
    import torch.distributed as dist

    mine = _lars_run(options, rank, device)
    reference = _lars_run(options, rank, torch.device("cpu"))
    largest_update = max((b - a).abs().max().item() for a, b in zip(reference["before"], reference["after"]))
    error = max((a - b).abs().max().item() for a, b in zip(mine["after"], reference["after"]))
    diverged = next((step for step, (a, b) in enumerate(zip(mine["chosen"], reference["chosen"])) if a != b), None)
    dist.barrier()
    return {"worst": error / max(largest_update, 1e-30), "diverged": diverged,
            "noise_parts": mine["noise_parts"], "noise_observed": mine["noise_observed"]}


def _parity_line(findings: list[dict[str, Any]]) -> tuple[str, str]:
    worst = max(f["worst"] for f in findings)
    diverged = [f["diverged"] for f in findings if f["diverged"] is not None]
    problems = []
    if diverged:
        problems.append(f"the chunks chosen differ from the CPU run's from step {min(diverged)} on")
    if not worst <= PARITY_TOLERANCE:  # a NaN is a failure too
        problems.append(f"parameters differ from the CPU run's by {worst:.3g} of the largest update")
    if not all(f["noise_observed"] for f in findings):
        problems.append("the trust ratio's noise correction has no running means "
                        f"(pool parts with layers per rank: {[f['noise_parts'] for f in findings]})")
    detail = (f"parameters after {PARITY_STEPS} steps of timm's Lars (momentum correction with LARS, noise "
              f"correction in {min(f['noise_parts'] for f in findings)} pool part(s), a loss scale on the device) "
              f"within {worst:.2g} of the largest update of the CPU run's (tolerance {PARITY_TOLERANCE:g}), "
              "the same chunks chosen at every step")
    return ("FAIL", f"{'; '.join(problems)} ({detail})") if problems else ("PASS", detail)


def _comm_line(label: str, options: dict[str, Any], findings: list[dict[str, Any]]) -> tuple[str, str]:
    from gradientflow_repro.comm.knobs import presets, resolve

    knobs = resolve(options)
    problems = [f"rank {r}: {p}" for r, f in enumerate(findings) for p in f["problems"]]
    missed = [r for r, f in enumerate(findings) if not f["inf_reached"]]
    if missed:
        problems.append(f"the inf in rank {len(findings) - 1}'s gradient did not reach rank(s) {missed}")
    notes = []
    preset = presets()[options["strategy"]]["algorithm"]
    if preset != knobs.algorithm:
        notes.append(f"algorithm={knobs.algorithm} instead of the preset's {preset} (gloo has no CUDA send/recv)")
    if knobs.sparsity == "csc":
        if len({json.dumps(f["selection"], sort_keys=True) for f in findings}) != 1:
            problems.append("ranks chose different chunks")
        if not all(f["held_back"] for f in findings):
            problems.append("no residual held back at density < 1")
        notes.append(f"density {findings[0]['density']:g}, p.grad + residuals = accumulated gradient mean")
    else:
        notes.append("p.grad = mean of the ranks' gradients")
    tolerance = "2e-3 of its message's largest (fp16 wire)" if knobs.wire == "fp16" else "rtol 1e-6"
    worst = max(f["worst"] for f in findings)
    detail = (f"{'; '.join(notes)}: worst |error| {worst:.2g} of the largest value (tolerance "
              f"{tolerance}), {max(f['ms'] for f in findings):.1f} ms/step (median of {COMM_STEPS}, "
              f"gloo via host memory), an inf on one rank reached {'both' if not missed else 'NOT both'}")
    if problems:
        return "FAIL", f"{'; '.join(problems[:4])} ({detail})"
    return "PASS", detail


def _comm_rank(rank: int, world: int, port: int, lines: Any, device_type: str = "cuda") -> None:
    """One of the item's ranks: every case of COMM_CASES and PARITY_CASES on ``device_type`` tensors
    (``cpu`` where there is no GPU: how the test suite checks the item itself)."""
    import torch.distributed as dist

    device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    cases = [(label, options, _check_communicator, functools.partial(_comm_line, label, options))
             for label, options in COMM_CASES]
    cases += [(label, options, _check_parity, _parity_line) for label, options in PARITY_CASES]
    for index, (label, options, check, verdict) in enumerate(cases):
        try:
            mine = check(options, rank, world, device)
        except Skip as skip:  # decided alike on every rank (a missing package): they stay in step
            if rank == 0:
                put_result(lines, Result("SKIP", f"comm_gloo_{device.type}/{label}", str(skip)))
            continue
        except Exception as error:  # noqa: BLE001 - report, then leave: the ranks are out of step
            traceback.print_exc()
            put_result(lines, Result("FAIL", f"comm_gloo_{device.type}/{label}", f"rank {rank}: {describe(error)}"))
            for later, *_ in cases[index + 1:]:
                put_result(lines, Result("SKIP", f"comm_gloo_{device.type}/{later}",
                                         f"not run: {label} failed on rank {rank}"))
            sys.stdout.flush()
            os._exit(REPORTED_EXIT)
        findings: list[Any] = [None] * world
        dist.all_gather_object(findings, mine)
        if rank == 0:
            status, detail = verdict(findings)
            put_result(lines, Result(status, f"comm_gloo_{device.type}/{label}", detail))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def spawn_ranks(report: Reporter, worker: Callable[..., None], world: int, limit_s: float) -> None:
    """Run ``worker(rank, world, port, lines)`` in ``world`` spawned processes, ``lines`` a queue the
    ranks put their results into (``put_result``): each becomes a line of ``report`` as it comes. A
    rank that fails or is still running after ``limit_s`` is a FAIL line (the others are killed)."""
    import torch.multiprocessing as mp

    lines = mp.get_context("spawn").SimpleQueue()

    def take_lines() -> None:
        while not lines.empty():
            report.add_result(Result(**lines.get()))

    context = mp.start_processes(worker, args=(world, free_port(), lines), nprocs=world, join=False,
                                 start_method="spawn")
    deadline = time.monotonic() + limit_s
    try:
        while not context.join(timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
            take_lines()
            if time.monotonic() >= deadline:
                running = [rank for rank, p in enumerate(context.processes) if p.is_alive()]
                report.add("FAIL", f"hung > {limit_s:.0f} s (rank(s) {running} still running); killed")
                break
    except mp.ProcessExitedException as error:
        if error.exit_code != REPORTED_EXIT:
            report.add("FAIL", f"rank {error.error_index} died: {describe(error)}")
    except mp.ProcessRaisedException as error:
        report.add("FAIL", f"rank {error.error_index}: {describe(error)}")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
            process.join(timeout=5)
        take_lines()


def put_result(lines: Any, result: Result) -> None:
    """In a spawned rank: hand ``result`` to ``spawn_ranks`` (a plain pipe write: safe before os._exit)."""
    lines.put(asdict(result))


def check_communicators(report: Reporter, device_type: Optional[str] = None) -> None:
    device_type = device_type or collective_device(0).type
    with project_imports():
        import gradientflow_repro.comm.factory  # noqa: F401 - fail here, not in both ranks
    spawn_ranks(report, functools.partial(_comm_rank, device_type=device_type), 2, max(5.0, time_left() - 5))


def check_communicators_on_cpu(report: Reporter) -> None:
    """The same item on CPU tensors: how the test suite checks the item itself without a GPU."""
    check_communicators(report, device_type="cpu")


# ---------------------------------------------------------------------------------------------
# 4. the trainer end to end: torchrun, CUDA, fp16, then resumed

TRAIN_OVERRIDES = ["+experiment=digits_cpu", "data=synthetic", "device=cuda", "precision=fp16",
                   "logger=jsonl", "logger.log_every=10", "dist_timeout_s=60"]
TRAIN_STRATEGIES = {"allreduce": [], "lazy": [], "gradientflow": ["comm.csc_warmup_epochs=0"]}


def _train(run_dir: Path, overrides: list[str], limit_s: float) -> tuple[str, dict[str, Any], float]:
    """One torchrun job; returns (its output, summary.json, seconds). Raises naming what went wrong."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
               "-m", "gradientflow_repro.train", *TRAIN_OVERRIDES, f"run_dir={run_dir}", *overrides]
    env = _child_env([str(REPO)])
    env.update(OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    status, output, seconds = run_command(command, limit_s, cwd=REPO, env=env)
    if status is None:
        raise RuntimeError(f"hung > {limit_s:.0f} s: {shlex.join(command[2:])}")
    if status != 0:
        raise RuntimeError(f"exit status {status}: {_error_line(output)[:300]}")
    return output, json.loads((run_dir / "summary.json").read_text()), seconds


def _error_line(output: str) -> str:
    """The line of a failed run that says what went wrong: the trainer's own "error: ..." line, else
    the last exception line, else the last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for line in lines:
        if line.startswith("error:"):
            return line
    raised = [line for line in lines if re.match(r"^[\w.]+(Error|Exception|Interrupt)\b", line)]
    return (raised or lines or [""])[-1]


def _final_loss(run_dir: Path) -> float:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in records if r.get("kind") == "train"][-1]["loss"]


def check_trainer(report: Reporter) -> None:
    need(*TRAINER_MODULES)
    cuda_device(0)
    root = Path(tempfile.mkdtemp(prefix="gpu_check_trainer_"))
    try:
        for strategy, extra in TRAIN_STRATEGIES.items():
            with report.part(strategy):
                run_dir = root / strategy
                _, first, first_s = _train(run_dir, [f"comm={strategy}", "max_steps=20", *extra],
                                           min(120.0, time_left() - 5))
                loss = _final_loss(run_dir)
                output, second, second_s = _train(run_dir, [f"comm={strategy}", "max_steps=30", "resume=auto",
                                                            *extra], min(120.0, time_left() - 5))
                problems = []
                if first["steps"] != 20:
                    problems.append(f"first run ended at step {first['steps']}, not 20")
                if not ("resumed from" in output and "at step 20" in output):
                    problems.append("the second run did not say 'resumed from ... at step 20'")
                if second["steps"] != 30:
                    problems.append(f"summary.json of the resumed run says steps = {second['steps']}, not 30")
                final = _final_loss(run_dir)
                if not math.isfinite(final):
                    problems.append(f"final loss {final}")
                detail = (f"20 steps in {first_s:.0f} s (loss {loss:.3f}, {first['skipped_steps']} skipped), "
                          f"resumed at step 20 to 30 in {second_s:.0f} s (loss {final:.3f}), "
                          f"{second['images_per_s']:.0f} img/s")
                report.add("FAIL" if problems else "PASS",
                           ("; ".join(problems) + f" ({detail})") if problems else detail, strategy)
    finally:
        shutil.rmtree(root, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# 5. throughput, and host synchronisations per step of the project's training step


def _images_per_s(name: str, device: torch.device, batch: int = 128, warmup: int = 5,
                  timed: int = 20) -> tuple[float, float]:
    """Images/s of the project's fp16 step (``precision.Precision``: autocast, the loss scale on the
    device, the finiteness flag read back once per step) with plain SGD on random 224-pixel images."""
    from types import SimpleNamespace

    from gradientflow_repro.models import build_model
    from gradientflow_repro.precision import Precision

    model = build_model(name, 1000, 224, 1.0, 0.5).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    # PrecisionConfig's fields (config.py imports Hydra: not needed for this item)
    precision = Precision(SimpleNamespace(dtype="fp16", init_scale=65536.0, growth_interval=2000), device)
    images = torch.randn(batch, 3, 224, 224, device=device)
    labels = torch.randint(1000, (batch,), device=device)
    loss = torch.zeros(())

    def step() -> None:
        nonlocal loss
        with precision.autocast():
            loss = torch.nn.functional.cross_entropy(model(images), labels)
        precision.backward(loss)
        precision.step(optimizer)
        optimizer.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    _synchronize(device)
    started = time.perf_counter()
    for _ in range(timed):
        step()
    _synchronize(device)
    seconds = time.perf_counter() - started
    if not torch.isfinite(loss):
        raise RuntimeError(f"loss is {loss.item()} after {warmup + timed} steps")
    return timed * batch / seconds, seconds / timed * 1e3


def throughput_verdict(rate: float, floor: float = PAPER_ALEXNET_IMAGES_PER_S) -> str:
    """PASS only above the paper's per-GPU figure: a GPU slower than the paper's cannot show its times."""
    return "PASS" if rate > floor else "FAIL"


def _trainer_for_sync_count(device: torch.device, run_dir: Path) -> Any:
    """A Trainer from the composed configuration: gradientflow, fp16, synthetic 64 px images."""
    from gradientflow_repro.config import compose
    from gradientflow_repro.distributed import discover_world
    from gradientflow_repro.engine import Trainer

    cfg = compose([*TRAIN_OVERRIDES, "comm=gradientflow", "comm.csc_warmup_epochs=0", f"run_dir={run_dir}",
                   "resume=never", "logger.log_every=1000000", "data.image_size=64",
                   "data.synthetic_train_size=1024", "data.synthetic_val_size=128"])
    return Trainer(cfg, discover_world({}), device)


def count_syncs(step: Callable[[], None], steps: int) -> list[warnings.WarningMessage]:
    """The synchronising CUDA calls ``steps`` calls of ``step`` make (torch's sync debug mode)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [w for w in caught if "synchroniz" in str(w.message)]


def check_throughput(report: Reporter) -> None:
    device = cuda_device(0)
    torch.backends.cudnn.benchmark = True
    setting = "batch 128, 224 px, the project's fp16 step (autocast, loss scale), SGD; 5 warm-up + 20 timed steps"
    with report.part("alexnet_bn"):
        rate, step_ms = _images_per_s("alexnet_bn", device)
        torch.cuda.empty_cache()  # the model is gone: give its memory back before the next
        status = throughput_verdict(rate)
        report.add(status, f"{rate:.0f} images/s ({step_ms:.1f} ms/step; {setting}): "
                   f"{'above' if status == 'PASS' else 'NOT above'} the paper's "
                   f"{PAPER_ALEXNET_IMAGES_PER_S:,.0f} images/s per GPU", "alexnet_bn")
    with report.part("resnet50"):
        need("torchvision")
        rate, step_ms = _images_per_s("resnet50", device)
        torch.cuda.empty_cache()
        # the paper gives no per-GPU figure for ResNet-50 to hold it to: the line passes on a
        # finite loss (checked in _images_per_s) and says so
        report.add("PASS", f"{rate:.0f} images/s ({step_ms:.1f} ms/step; {setting}), finite loss "
                   "(no floor: the paper gives no per-GPU ResNet-50 figure)", "resnet50")
    with report.part("host syncs per step"):
        steps = 5
        per_step, where = trainer_step_syncs(device, steps)
        report.add("PASS" if per_step <= 1 else "FAIL",
                   f"{per_step:g} per step (target <= 1) over {steps} Trainer.train_step calls (gradientflow, "
                   f"fp16, one NCCL rank, 64 px); from {where}", "host syncs per step")


def trainer_step_syncs(device: torch.device, steps: int) -> tuple[float, str]:
    """Synchronising calls per ``Trainer.train_step`` after three warm-up steps, and where they come
    from (file:line x count). One rank in a process group of its own, as under torchrun."""
    import torch.distributed as dist

    need(*TRAINER_MODULES)
    run_dir = Path(tempfile.mkdtemp(prefix="gpu_check_syncs_"))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    cuda = device.type == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1, device_id=device if cuda else None,
                            timeout=datetime.timedelta(seconds=60))
    try:
        with project_imports():
            trainer = _trainer_for_sync_count(device, run_dir)
        images, labels = next(iter(trainer.data.train_batches(0)))
        for _ in range(3):
            trainer.train_step(images, labels)
        if cuda:
            torch.cuda.synchronize(device)
        syncs = count_syncs(lambda: trainer.train_step(images, labels), steps)
        trainer.comm.close()
    finally:
        dist.destroy_process_group()
        shutil.rmtree(run_dir, ignore_errors=True)
    sources = collections.Counter(f"{Path(w.filename).name}:{w.lineno}" for w in syncs)
    return len(syncs) / steps, ", ".join(f"{source} x{count}" for source, count in sources.most_common(8)) or "none"


# ---------------------------------------------------------------------------------------------
# 6. DALI: GPU (mixed) and CPU pipelines over one epoch of the digits


def digits_root() -> Path:
    root = REPO / "data" / "digits"
    if (root / "train").is_dir() and (root / "val").is_dir():
        return root
    need("sklearn", "PIL")
    status, output, _ = run_command([sys.executable, "-m", "gradientflow_repro.data.digits", str(root)],
                                    min(180.0, time_left() - 5), cwd=REPO, env=_child_env([str(REPO)]))
    if status != 0:
        last = [line for line in output.splitlines() if line.strip()][-1:] or [""]
        raise RuntimeError(f"building {root} failed (status {status}): {last[0][:300]}")
    return root


def check_dali(report: Reporter) -> None:
    need("nvidia.dali")
    cuda_device(0)
    with project_imports():
        from gradientflow_repro.data.dali import DaliSource
        from gradientflow_repro.data.listing import ImageOptions, epoch_permutation, list_image_folder
    root = digits_root()
    train = list_image_folder(root / "train")
    val = list_image_folder(root / "val", train.classes)
    options = ImageOptions(image_size=32, val_resize=32, min_crop_scale=0.6, flip=False,
                           mean=(0.0,) * 3, std=(255.0,) * 3, num_threads=4, prefetch=2)
    batch = 64
    steps = len(train) // batch
    expected = [train.labels[i] for i in epoch_permutation(len(train), 0, 0)][:steps * batch]
    for label, device in (("mixed on cuda:0", torch.device("cuda", 0)), ("cpu", torch.device("cpu"))):
        with report.part(label):
            source = DaliSource(train, val, options, device=device, local_batch=batch, global_batch=batch,
                                rank=0, world_size=1, seed=0)
            labels, problems = [], []
            started = time.perf_counter()
            for images, targets in source.train_batches(0):
                if tuple(images.shape) != (batch, 3, 32, 32) or images.device.type != device.type:
                    problems.append(f"a batch of shape {tuple(images.shape)} on {images.device}")
                labels += targets.cpu().tolist()
            torch.cuda.synchronize()
            seconds = time.perf_counter() - started
            if labels != expected:
                problems.append(f"labels differ from the epoch's order ({len(labels)} read, "
                                f"{sum(a != b for a, b in zip(labels, expected))} differ)")
            detail = (f"{len(labels) / seconds:.0f} images/s over one epoch ({steps} batches of {batch}, "
                      f"32 px, pipeline build included), labels in the epoch's order")
            report.add("FAIL" if problems else "PASS",
                       ("; ".join(problems[:3]) + f" ({detail})") if problems else detail, label)


# ---------------------------------------------------------------------------------------------
# 7. two GPUs: our sums and the trainer's helpers against NCCL's, lazy allreduce against the
#    reference, and no stray context on GPU 0

TWO_GPU_SIZES = (1, 7, 1000003)
TWO_GPU_ITEM = "nccl_2gpu"


def _two_gpu_rank(rank: int, world: int, port: int, lines: Any) -> None:
    """One NCCL rank per GPU (``cuda:rank``), or a gloo rank on the CPU under the test device."""
    import torch.distributed as dist

    device = torch.device("cpu") if test_device() == "cpu" else torch.device("cuda", rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # as the trainer does
    dist.init_process_group(backend_for(device), init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, device_id=device if device.type == "cuda" else None,
                            timeout=datetime.timedelta(seconds=45))
    report = Reporter(TWO_GPU_ITEM, functools.partial(put_result, lines) if rank == 0 else (lambda result: None))
    try:
        compare_with_builtin_allreduce(report, rank, world, device)
        helpers_across_ranks(report, rank, world, device)
        lazy_without_stray_context(report, rank, world, device)
    except Exception as error:  # noqa: BLE001 - report, then leave: the ranks are out of step
        traceback.print_exc()
        put_result(lines, Result("FAIL", TWO_GPU_ITEM, f"rank {rank}: {describe(error)}"))
        sys.stdout.flush()
        os._exit(REPORTED_EXIT)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def compare_with_builtin_allreduce(report: Reporter, rank: int, world: int, device: torch.device) -> None:
    """Ring and hierarchical (one rank per node, and all in one node) sums against the backend's allreduce, on odd sizes
    in fp32 and fp16; one line per algorithm and type (rank 0 reports the worst rank)."""
    import torch.distributed as dist

    from gradientflow_repro.comm.base import CommStats
    from gradientflow_repro.comm.hierarchical import HierarchicalSum
    from gradientflow_repro.comm.ring import ring_allreduce_

    # one rank per node: the ring among leaders; all ranks in one node: reduce and broadcast on the
    # node's group (the ops that share NCCL's streams with the leaders' ring on a real cluster)
    across_nodes, inside_node = HierarchicalSum(ranks_per_node=1), HierarchicalSum(ranks_per_node=world)
    algorithms: dict[str, Callable[[torch.Tensor], Any]] = {
        "ring": lambda t: ring_allreduce_(t),
        "hierarchical (1 rank per node)": lambda t: across_nodes(t, CommStats()),
        f"hierarchical ({world} ranks per node)": lambda t: inside_node(t, CommStats())}
    for dtype in (torch.float32, torch.float16):
        errors: dict[str, list[float]] = {name: [] for name in algorithms}
        for numel in TWO_GPU_SIZES:
            x = torch.randn(numel, generator=torch.Generator().manual_seed(1000 * rank + numel)).to(device, dtype)
            expected = x.clone()
            dist.all_reduce(expected)
            peak = max(expected.float().abs().max().item(), 1e-30)
            for name, algorithm in algorithms.items():
                got = x.clone()
                algorithm(got)
                break_sum(got)
                errors[name].append((got.float() - expected.float()).abs().max().item() / peak)
        big = torch.randn(TWO_GPU_SIZES[-1], device=device).to(dtype)
        builtin_us = median_us(lambda: dist.all_reduce(big.clone()), device, 1, 5)
        tolerance = 1e-6 if dtype == torch.float32 else 1e-3  # fp16: one rounding of the sum
        for name, algorithm in algorithms.items():
            gathered: list[Any] = [None] * world
            dist.all_gather_object(gathered, errors[name])
            worst = [max(r[i] for r in gathered) for i in range(len(TWO_GPU_SIZES))]
            micros = median_us(lambda: algorithm(big.clone()), device, 1, 5)
            report.add("PASS" if max(worst) <= tolerance else "FAIL",
                       f"sizes {', '.join(map(str, TWO_GPU_SIZES))}: |error| "
                       f"{', '.join(f'{w:.1g}' for w in worst)} of the largest value vs dist.all_reduce "
                       f"(tolerance {tolerance:g}); {TWO_GPU_SIZES[-1]} elements: {micros / 1e3:.2f} ms, "
                       f"the backend's own {builtin_us / 1e3:.2f} ms", f"{name} {str(dtype).split('.')[-1]}")


def helpers_across_ranks(report: Reporter, rank: int, world: int, device: torch.device) -> None:
    """The trainer's collective helpers (which return before any collective at world size 1) on
    rank-dependent values, against what every rank must get; rank 0 reports the ranks' verdicts."""
    import torch.distributed as dist

    from gradientflow_repro.distributed import agree_max, all_reduce_scalars, barrier, ranks_that_differ

    flag = torch.full((), float(rank == world - 1), device=device)  # only the last rank overflowed
    got = {"agree_max": agree_max([flag, float(10 + rank)], device),
           "all_reduce_scalars": all_reduce_scalars([float(rank + 1), -0.5], device),
           "ranks_that_differ": ranks_that_differ([torch.full((3,), float(rank > 0), device=device)], device)}
    got["all_reduce_scalars"][:1] = break_sum(torch.tensor(got["all_reduce_scalars"][:1])).tolist()
    want = {"agree_max": [1.0, float(9 + world)],
            "all_reduce_scalars": [float(world * (world + 1) // 2), -0.5 * world],
            "ranks_that_differ": list(range(1, world))}
    barrier(device)
    wrong = [f"{name} gave {got[name]}, not {want[name]}" for name in want if got[name] != want[name]]
    verdicts: list[Any] = [None] * world
    dist.all_gather_object(verdicts, wrong)
    if rank == 0:
        problems = [f"rank {r}: {w}" for r, ranks in enumerate(verdicts) for w in ranks]
        report.add("FAIL" if problems else "PASS", "; ".join(problems[:4]) if problems else
                   f"agree_max, all_reduce_scalars, ranks_that_differ and barrier through {dist.get_backend()} "
                   f"on rank-dependent values: every rank got the right answer", "the trainer's helpers")


def lazy_without_stray_context(report: Reporter, rank: int, world: int, device: torch.device) -> None:
    """A few steps of the lazy communicator (its default algorithm, overlap on its thread and
    stream) whose gradients must equal the mean of the ranks' reference gradients, summed by
    ``dist.all_reduce`` (ranks that merely agree with each other do not pass: a stale pool agrees
    too); and on GPUs rank 1's process must hold no CUDA context on GPU 0."""
    import torch.distributed as dist

    from gradientflow_repro.comm.factory import build_communicator
    from gradientflow_repro.distributed import barrier

    torch.manual_seed(0)
    model = SmallNet().to(device)
    reference = copy.deepcopy(model)
    comm = build_communicator({"strategy": "lazy"}, device)
    module = comm.attach(model, torch.optim.SGD(model.parameters(), lr=0.1))
    stale_pool(comm)
    worst = 0.0
    steps = 3
    for step in range(steps):
        x = torch.randn(16, 37, generator=torch.Generator().manual_seed(100 * rank + step)).to(device)
        reference.zero_grad(set_to_none=True)
        reference(x).pow(2).mean().backward()
        expected = [p.grad.detach().clone() for p in reference.parameters()]
        for grad in expected:
            dist.all_reduce(grad)
            grad.div_(world)
        comm.begin_step(float(step), 1.0)
        module(x).pow(2).mean().backward()
        comm.synchronize()
        for param, want in zip(model.parameters(), expected):
            peak = max(want.abs().max().item(), 1e-30)
            worst = max(worst, (param.grad - want).abs().max().item() / peak)
        comm.end_step(applied=True)
        model.zero_grad(set_to_none=True)
    comm.close()
    tolerance = 1e-5  # fp32 sums in another order than the reference's
    who: list[Any] = [None] * world
    dist.all_gather_object(who, (os.getpid(), cuda_uuid(rank) if device.type == "cuda" else None, worst))
    if rank == 0:  # rank 0 alone looks while rank 1 waits, alive, at the barrier
        errors = [w for *_, w in who]
        part = "lazy vs dist.all_reduce"
        with report.part(part):
            ok = all(e <= tolerance for e in errors)  # a NaN fails too
            report.add("PASS" if ok else "FAIL",
                       f"{steps} lazy steps: |p.grad - dist.all_reduce(reference gradients) / {world}| at most "
                       f"{', '.join(f'{e:.2g}' for e in errors)} (per rank) of the largest value "
                       f"(tolerance {tolerance:g})", part)
        if device.type == "cuda":
            part = "no context of rank 1 on GPU 0"
            with report.part(part):
                report.add(*_stray_context_verdict([w[:2] for w in who]), part)
    barrier(device)


def _stray_context_verdict(who: list[tuple[int, Optional[str]]]) -> tuple[str, str]:
    """Whether rank 1's process holds a context on GPU 0, from NVML's process lists."""
    processes = gpu_processes()
    if processes is None:
        raise Skip("neither pynvml nor nvidia-smi can list GPU processes")
    (_, gpu0), (pid1, gpu1) = who[0], who[1]
    order = list(processes)
    gpu0, gpu1 = gpu0 or (order[0] if order else None), gpu1 or (order[1] if len(order) > 1 else None)
    if pid1 not in processes.get(gpu1, set()):
        raise Skip(f"NVML does not list rank 1 (pid {pid1}) on its own GPU either: it cannot see this "
                   f"container's PIDs, so GPU 0 cannot be checked")
    if pid1 in processes.get(gpu0, set()):
        return "FAIL", f"rank 1 (pid {pid1}, cuda:1) holds a CUDA context on GPU 0"
    return "PASS", f"rank 1 (pid {pid1}) is on GPU 1 only after the lazy steps (ring over NCCL, overlap)"


def check_two_gpus(report: Reporter) -> None:
    collective_device(1)
    with project_imports():
        import gradientflow_repro.comm.factory  # noqa: F401
    spawn_ranks(report, _two_gpu_rank, 2, max(5.0, time_left() - 5))


# ---------------------------------------------------------------------------------------------
# The list, the report file and the command line

# In the order they run: what needs several GPUs first (a check cut short has crossed GPUs), then
# what needs only torch, then what needs the trainer's packages. Nominal limits sum to less than
# the budget on one GPU; each item's limit is its share of what is left (``item_limit``).
ITEMS = [
    Item("environment", check_environment, 60, 0, "versions, GPUs and their arch, DALI, optional packages"),
    Item("nccl_2gpu", check_two_gpus, 60, 2, "ring, hierarchical and the trainer's helpers vs NCCL on 2 GPUs; "
         "lazy vs dist.all_reduce of the reference; no stray context on GPU 0", on_test_cpu=True),
    Item("nccl_1rank", check_nccl_single_rank, 45, 1,
         "every collective the trainer's helpers send, through NCCL at world size 1, results checked (us/call)",
         on_test_cpu=True),
    Item("comm_gloo_cuda", check_communicators, 90, 1,
         "every communicator on CUDA tensors, 2 gloo ranks on GPU 0, against the mean gradient", on_test_cpu=True),
    Item("throughput", check_throughput, 75, 1, f"AlexNet-BN images/s in fp16 against the paper's "
         f"{PAPER_ALEXNET_IMAGES_PER_S:,.0f} per GPU, ResNet-50's; host syncs per step"),
    Item("trainer_fp16", check_trainer, 150, 1, "torchrun + fp16 on CUDA (allreduce, lazy, gradientflow), resumed"),
    Item("dali", check_dali, 45, 1, "DALI mixed (GPU) and CPU pipelines over one epoch of the digits"),
]
ITEM_BY_NAME = {item.name: item for item in ITEMS}
MIN_ITEM_S = 15.0  # an item given less than this is SKIP: it could not even start CUDA and NCCL


def item_limit(item: Item, later: list[Item], left_s: float) -> float:
    """The limit of ``item`` when ``left_s`` of the budget is left and ``later`` will run after it:
    its nominal limit, or its share of what is left in proportion to the nominal limits still to
    run, whichever is less. Summed over the items this never exceeds the budget."""
    share = left_s * item.timeout_s / (item.timeout_s + sum(other.timeout_s for other in later))
    return min(item.timeout_s, share)


def header_lines(command: str) -> list[str]:
    facts = environment_facts()
    lines = [f"- date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
             f"- host: {socket.gethostname()}",
             f"- GPUs: {gpu_summary(facts)}",
             f"- versions: {versions_summary(facts)}, Python {facts['python']}",
             f"- git commit: {git_commit() or 'unknown'}",
             f"- command: `{command}`"]
    if test_hooks_set():
        lines.append(f"- TEST HOOKS SET (not a check of this machine): {test_hooks_set()}")
    return lines


def write_report(path: Path, header: list[str], results: list[Result], state: str,
                 limits: Optional[dict[str, float]] = None) -> None:
    limits = limits or {}

    def limit(item: Item) -> str:
        if not item.gpus:
            return "in the main process"
        return f"{limits[item.name]:.0f} s" if item.name in limits else f"{item.timeout_s:.0f} s nominal"

    lines = ["# GPU check", "", *header, f"- result: {state}", "", "```text",
             *(result.line() for result in results), "```", "", "Items (each with its own time limit):", "",
             *(f"- `{item.name}` ({limit(item)}): {item.doc}" for item in ITEMS), ""]
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text("\n".join(lines))
    partial.replace(path)


def tally(results: list[Result]) -> str:
    counts = collections.Counter(result.status for result in results)
    return ", ".join(f"{counts[s]} {s}" for s in ("PASS", "FAIL", "SKIP"))


class BadOption(Exception):
    """An option the check refuses before running anything (one line, exit status 2)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override] - one line, not the usage
        raise BadOption(message)


def log_path(out: Path) -> Path:
    return out.with_name(out.name + ".log") if out.suffix in ("", ".log") else out.with_suffix(".log")


def check_writable(path: Path, what: str) -> None:
    """Refuse, naming ``what``, a path that is a directory or cannot be written. Its directory is
    created; the file is opened for appending (what a write would need) and left as it was."""
    if path.is_dir():
        raise BadOption(f"{what} {path} is a directory: name a file (e.g. {path / 'gpu_check.md'})")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        existed = path.exists()
        with open(path, "a"):
            pass
        if not existed:
            path.unlink()
    except OSError as error:
        raise BadOption(f"{what} {path} cannot be written: {error.strerror or error}") from None


def parse_options(argv: Optional[list[str]]) -> argparse.Namespace:
    """The options, or BadOption naming the first bad one (nothing has run yet)."""
    parser = _Parser(prog="gradientflow_repro.gpu_check", description=__doc__.split("\n\n")[0],
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"report file (default {DEFAULT_OUT}); "
                        "the children's output goes to the .log beside it")
    parser.add_argument("--only", nargs="+", metavar="ITEM",
                        help=f"run only these items, of: {', '.join(ITEM_BY_NAME)}")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S,
                        help=f"the whole check's time limit (default {BUDGET_S:.0f} s): each item gets its "
                             "share of what is left; items past it are SKIP")
    parser.add_argument("--strict", action="store_true", help="exit status 1 on a SKIP too (by default only a "
                        "FAIL makes it non-zero)")
    args = parser.parse_args(argv)
    unknown = [name for name in args.only or [] if name not in ITEM_BY_NAME]
    if unknown:
        raise BadOption(f"--only: unknown item(s) {', '.join(unknown)}; the items are {', '.join(ITEM_BY_NAME)}")
    if not (math.isfinite(args.budget_s) and args.budget_s >= MIN_ITEM_S):
        raise BadOption(f"--budget-s {args.budget_s:g}: give at least {MIN_ITEM_S:.0f} s")
    problem = test_hooks_problem()
    if problem:
        raise BadOption(problem)
    check_writable(args.out, "--out")
    check_writable(log_path(args.out), "the log beside --out,")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    try:
        args = parse_options(argv)
    except BadOption as error:
        print(f"gpu_check: error: {error}", file=sys.stderr, flush=True)
        return 2
    command = shlex.join([sys.executable, *sys.argv]) if argv is None else shlex.join(
        [sys.executable, "-m", "gradientflow_repro.gpu_check", *argv])
    started = time.monotonic()
    header = header_lines(command)
    results: list[Result] = []
    limits: dict[str, float] = {}
    chosen = [item for item in ITEMS if not args.only or item.name in args.only]
    gates = {item.name: gpu_gate(item.gpus, item.on_test_cpu) for item in chosen}

    def emit(result: Result) -> None:
        print(result.line(), flush=True)
        results.append(result)

    with open(log_path(args.out), "w") as log_file:
        def log(line: str) -> None:
            log_file.write(line + "\n")
            log_file.flush()

        for index, item in enumerate(chosen):
            write_report(args.out, header, results, f"running {item.name} ({tally(results)} so far)", limits)
            left = args.budget_s - (time.monotonic() - started)
            later = [other for other in chosen[index + 1:] if other.gpus and not gates[other.name]]
            limit = item_limit(item, later, left) if item.gpus else min(item.timeout_s, left)
            reason = gates[item.name] or (None if limit >= MIN_ITEM_S else (
                f"the check's {args.budget_s:.0f} s budget is spent ({left:.0f} s left)"))
            try:
                if reason:
                    emit(Result("SKIP", item.name, reason))
                elif item.gpus == 0:
                    run_here(item, emit)
                else:
                    limits[item.name] = limit
                    run_in_child(dataclasses.replace(item, timeout_s=limit), emit, log)
            except KeyboardInterrupt:
                write_report(args.out, header, results, f"interrupted during {item.name} ({tally(results)})", limits)
                print(f"interrupted during {item.name}; partial report: {args.out}", flush=True)
                return 130
    failed = any(result.status == "FAIL" for result in results)
    skipped = [result.item for result in results if result.status == "SKIP"]
    status = 1 if failed or (args.strict and skipped) else 0
    state = (f"{tally(results)} in {time.monotonic() - started:.0f} s; exit status {status}"
             + (f"; not checked here: {', '.join(skipped)}" if skipped else ""))
    write_report(args.out, header, results, state, limits)
    print(f"{state}; report: {args.out}", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())

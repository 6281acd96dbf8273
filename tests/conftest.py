"""Shared helpers: the embedded dataset, launching real multi-process training with torchrun or as
``make reproduce`` does (``train``), and (from ``gradientflow_repro.cluster.world``) ``spawn`` and
``free_port`` for gloo processes."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import pytest
import torch

# a port, and a function in N gloo processes: the package's helpers, re-exported for the tests
from gradientflow_repro.cluster.world import free_port, spawn  # noqa: F401

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
# faults planned with GFR_INJECT_FAULT fire only where this is set too (gradientflow_repro/faults.py);
# every process the tests start inherits it
os.environ["GFR_ALLOW_FAULTS"] = "1"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--fast", action="store_true",
                     help="the fast tier (make test-fast): a test that starts a Python process (ranks, "
                          "torchrun, a script) is skipped where it would start it; the full suite runs it")


def _launches(command: object) -> bool:
    """Whether a ``subprocess`` command starts a Python process or a job (ranks, torchrun, a script,
    make, Slurm): what the fast tier leaves to the full suite. Other commands (git, bash -n) are cheap."""
    text = command if isinstance(command, str) else " ".join(map(str, command))  # type: ignore
    return any(word in text for word in ("python", "torchrun", "srun", "sbatch", "slurm", "make "))


FAST_TIER_SKIP = "starts a process: in the full suite only (make test)"
_running: list[pytest.Item] = []  # the test being run (its fixtures included), for the fast tier


def _refuse_launch(*args: object, **kwargs: object) -> None:
    if _running:  # a test that catches the skip (a thread, except BaseException) still ends skipped
        _running[-1].fast_tier_launched = True  # type: ignore[attr-defined]
    pytest.skip(FAST_TIER_SKIP)


def pytest_configure(config: pytest.Config) -> None:
    """Under ``--fast``, for the whole session (module and session fixtures included): starting a
    Python process (a subprocess, a multiprocessing or fork server child, a fork) skips the test
    that asked for it, so the tier runs in-process work only."""
    if not config.getoption("--fast"):
        return
    import multiprocessing.process

    popen_init = subprocess.Popen.__init__

    def popen(self: subprocess.Popen, args: object, *rest: object, **options: object) -> None:
        if _launches(args):
            _refuse_launch()
        popen_init(self, args, *rest, **options)
    subprocess.Popen.__init__ = popen  # type: ignore[method-assign]
    multiprocessing.process.BaseProcess.start = _refuse_launch  # type: ignore[method-assign]
    os.fork = _refuse_launch  # type: ignore[assignment]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: object) -> object:
    _running.append(item)
    try:
        yield
    finally:
        _running.pop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> object:
    """Under ``--fast``, a test that tried to start a process is skipped, whatever it did with the
    skip."""
    outcome = yield
    report = outcome.get_result()
    if getattr(item, "fast_tier_launched", False) and report.failed:
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] or 0, f"Skipped: {FAST_TIER_SKIP}")


@pytest.fixture(scope="session")
def digits_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from gradientflow_repro.data.digits import build_digits

    built = REPO / "data" / "digits"
    if (built / "train").is_dir():
        return built
    return build_digits(tmp_path_factory.mktemp("data") / "digits")


# Small and quick: 1/8-width AlexNet-BN on the digits, no wandb.
FAST = ["+experiment=digits_cpu", "model.width=0.125", "logger=jsonl", "logger.log_every=1",
        "threads_per_rank=1", "dist_timeout_s=60"]


def script_module(name: str) -> ModuleType:
    """``scripts/NAME.py`` loaded as a module (the scripts are not a package), for its functions."""
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def for_this_cpu(overrides: list[str]) -> list[str]:
    """``overrides`` and what this machine needs, as ``make reproduce`` adds it: digits_cpu trains
    under bf16 autocast, which a CPU without native bf16 emulates at many times fp32's time, so
    there a run trains in fp32 unless it names a precision (the tests about bf16 do)."""
    from gradientflow_repro.reproduction.reproduce import machine_overrides

    try:
        return [*overrides, *machine_overrides(overrides)]
    except Exception:  # noqa: BLE001 (overrides that do not compose: the run itself must say why, as it is)
        return overrides


def torchrun_command(nproc: int, overrides: list[str], run_dir: Path,
                     env: dict[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    """The command and environment of a training launch by torchrun on loopback, for
    ``subprocess`` (``cwd=REPO``): one thread per rank, wandb offline, and this CPU's precision
    override (``for_this_cpu``). The one definition, so every test launches training alike."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1",
               f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1", f"--master-port={free_port()}",
               "-m", "gradientflow_repro.train", f"run_dir={run_dir}", *for_this_cpu(overrides)]
    return command, {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", **(env or {})}


def torchrun(nproc: int, overrides: list[str], run_dir: Path, timeout: float = 240,
             check: bool = True, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    command, env = torchrun_command(nproc, overrides, run_dir, env)
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)
    if check and result.returncode != 0:
        raise AssertionError(f"torchrun failed ({result.returncode}):\n{result.stdout[-4000:]}\n"
                             f"{result.stderr[-6000:]}")
    return result


def train(nproc: int, overrides: list[str], run_dir: Path, timeout: float = 240) -> str:
    """A training launch on loopback by ``cluster.launch.run_ranks``, as ``make reproduce`` launches
    its ranks: the environment torchrun gives (rank, local rank, world size, master), one thread per
    rank, wandb offline, this CPU's precision override. The ranks are forked from a rank server that
    imported torch once (``cluster.preloaded``) where that is safe, so they skip seconds of imports
    each; tests of what torchrun itself does (the entry point, a lost rank, signals) use
    ``torchrun``. Returns rank 0's
    output; a failed rank fails with every failed rank's last lines."""
    from gradientflow_repro.cluster.launch import run_ranks

    run_ranks(nproc, [f"run_dir={run_dir}", *for_this_cpu(overrides)], run_dir, "train", None, timeout, show=False)
    return (run_dir / "rank0.log").read_text()


def wandb_records(run_file: Path) -> list:
    """The protobuf ``Record``s of an offline wandb run file (``run-<id>.wandb``), in order. The file
    is a LevelDB-style log (32 KiB blocks of records with a 7-byte header: crc, length, type) after a
    7-byte ':W&B' header, each record one protobuf ``Record``. Parsed by hand: wandb 0.31 has no
    Python reader for these files any more (its ``sdk.internal.datastore`` moved into the Go
    ``wandb-core``), only the protobuf classes."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B", f"{run_file} is not a wandb run file"
    records, position, pending = [], 7, b""
    while position + 7 <= len(data):
        left_in_block = 32768 - position % 32768
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        if left_in_block < 7 or (kind == 0 and length == 0):  # block padding
            position += left_in_block
            continue
        pending += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a whole record, or the last fragment of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def wandb_history_keys(wandb_file: Path) -> set[str]:
    """Metric names in the history of an offline wandb run file (``run-<id>.wandb``): what the
    dashboards can plot."""
    return {item.key or "/".join(item.nested_key) for record in wandb_records(wandb_file)
            if record.WhichOneof("record_type") == "history" for item in record.history.item}


def final_params(run_dir: Path, rank: int) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / f"final_params_rank{rank}.pt", weights_only=True)


def requires_cuda(reason: str = "needs a CUDA GPU") -> pytest.MarkDecorator:
    return pytest.mark.skipif(not torch.cuda.is_available(), reason=reason)


def save_failures(failures: list[str], out: str, rank: int) -> None:
    """A spawned rank's list of what went wrong on it (empty: nothing), for ``assert_no_failures``."""
    torch.save(failures, Path(out) / f"rank{rank}.pt")


def assert_no_failures(out: Path, world: int) -> None:
    """Each spawned rank saved the list of what went wrong on it as ``out/rank<r>.pt``."""
    for rank in range(world):
        failures = torch.load(out / f"rank{rank}.pt")
        assert failures == [], f"rank {rank}: {failures}"


def spawn_checked(fn: Callable[..., None], world: int, out: Path, *args: Any, **options: Any) -> None:
    """``fn(rank, world, str(out), *args)`` in ``world`` gloo processes (``spawn``; ``options``: its
    ``backend`` and ``timeout_s``), each saving what went wrong on it (``save_failures``); fails with
    any rank's failures."""
    spawn(fn, world, str(out), *args, **options)
    assert_no_failures(out, world)

"""The project's training step on a GPU: the items ``throughput`` and ``trainer_fp16``.

``throughput``: images/s of the project's fp16 step (``precision.Precision``: autocast, loss
scale, the agreed finiteness check) on AlexNet-BN, against the paper's figure per GPU: PASS only
above it (a GPU slower than the paper's cannot show its times); ResNet-50's figure beside it; how
much CSC's local work on a side stream slows the step beside it (``local_work_beside_step``: the
figure the scaling model's ``Network.local_work_slowdown`` stands for, unmeasured elsewhere); and
the host synchronisations per step of the trainer's own step (at most one).

``trainer_fp16``: the trainer end to end through torchrun on CUDA with fp16, for each strategy of
``TRAIN_STRATEGIES``, then resumed from its checkpoint.

The AlexNet-BN figure needs only torch (``precision.py`` imports neither Hydra nor PyYAML); the
trainer and the host-synchronisation count need what the trainer imports (``TRAINER_MODULES``).
"""

from __future__ import annotations

import collections
import datetime
import json
import math
import os
import re
import shlex
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

from gradientflow_repro import REPO
from gradientflow_repro.cluster.world import free_port
from gradientflow_repro.gpu_check.devices import cuda_device, median_us, synchronize
from gradientflow_repro.gpu_check.processes import child_env, run_command, time_left
from gradientflow_repro.gpu_check.results import Reporter, need, project_imports

# What the trainer imports with logger=jsonl data=synthetic (neither wandb nor DALI)
TRAINER_MODULES = ("hydra", "omegaconf", "antlr4", "yaml", "timm", "mlperf_logging", "matplotlib")
# The paper's single-GPU throughput of AlexNet-BN in fp16: 1,281,167 images x 95 epochs in 90 s on
# 410.2 GPU-equivalents (its own figures): the bar this machine's fp16 step has to beat.
PAPER_ALEXNET_IMAGES_PER_S = 3297.0

# ---------------------------------------------------------------------------------------------
# trainer_fp16: the trainer end to end, torchrun, CUDA, fp16, then resumed

TRAIN_OVERRIDES = ["+experiment=digits_cpu", "data=synthetic", "device=cuda", "precision=fp16",
                   "logger=jsonl", "logger.log_every=10", "dist_timeout_s=60"]
TRAIN_STRATEGIES = {"allreduce": [], "lazy": [], "gradientflow": ["comm.csc_warmup_epochs=0"]}


def _train(run_dir: Path, overrides: list[str], limit_s: float) -> tuple[str, dict[str, Any], float]:
    """One torchrun job; returns (its output, summary.json, seconds). Raises naming what went wrong."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
               "-m", "gradientflow_repro.train", *TRAIN_OVERRIDES, f"run_dir={run_dir}", *overrides]
    env = child_env([str(REPO)])
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
    """The last training loss a run logged."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in records if r.get("kind") == "train"][-1]["loss"]


def check_trainer(report: Reporter) -> None:
    """The item ``trainer_fp16``: per strategy, 20 steps, then resumed from the checkpoint to 30."""
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
# throughput, and host synchronisations per step of the project's training step


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
    synchronize(device)
    started = time.perf_counter()
    for _ in range(timed):
        step()
    synchronize(device)
    seconds = time.perf_counter() - started
    if not torch.isfinite(loss):
        raise RuntimeError(f"loss is {loss.item()} after {warmup + timed} steps")
    return timed * batch / seconds, seconds / timed * 1e3


def local_work_beside_step(name: str, device: torch.device, batch: int = 128, image: int = 224, width: float = 1.0,
                           warmup: int = 3, timed: int = 10) -> tuple[float, float, float, float]:
    """How much CSC's local work slows a training step it runs beside, as the pool runs it (on a
    side stream of the same GPU, ``comm/lazy.py``): median milliseconds of the fp16 step alone, of
    the local work alone (``profile.sparsify_work`` over the model's gradient elements), and of both
    started together, and the slowdown (both - step) / local: 0 when the local work hides entirely
    beside the step, 1 when they take turns. On the CPU (no streams) they run one after the other."""
    from types import SimpleNamespace

    from gradientflow_repro.models import build_model
    from gradientflow_repro.precision import Precision
    from gradientflow_repro.scaling.profile import sparsify_work

    model = build_model(name, 1000, image, width, 0.5).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    precision = Precision(SimpleNamespace(dtype="fp16" if device.type == "cuda" else "fp32", init_scale=65536.0,
                                          growth_interval=2000), device)
    images = torch.randn(batch, 3, image, image, device=device)
    labels = torch.randint(1000, (batch,), device=device)
    local, _ = sparsify_work(sum(p.numel() for p in model.parameters()), device=device)
    side = torch.cuda.Stream(device) if device.type == "cuda" else None

    def step() -> None:
        with precision.autocast():
            loss = torch.nn.functional.cross_entropy(model(images), labels)
        precision.backward(loss)
        precision.step(optimizer)
        optimizer.zero_grad(set_to_none=True)

    def beside() -> None:
        if side is None:
            local()
            return
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            local()

    def both() -> None:
        beside()
        step()

    step_ms, local_ms, both_ms = (median_us(work, device, warmup, timed) / 1e3 for work in (step, beside, both))
    return step_ms, local_ms, both_ms, max(0.0, both_ms - step_ms) / local_ms


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
    """The item ``throughput``: AlexNet-BN's and ResNet-50's images/s; host syncs per trainer step."""
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
    with report.part("local work beside backward"):
        step_ms, local_ms, both_ms, slowdown = local_work_beside_step("alexnet_bn", device)
        torch.cuda.empty_cache()
        report.add("PASS", f"step {step_ms:.1f} ms alone, CSC's local work over AlexNet-BN's gradients (density "
                   f"0.1) {local_ms:.1f} ms alone on a side stream, both at once {both_ms:.1f} ms: the step "
                   f"slowed by {slowdown:.2f} s per second of local work beside it (the scaling model's "
                   "Network.local_work_slowdown: by default the communication's fitted 0.24; the paper's band "
                   "spans up to 1)", "local work beside backward")
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

"""Every communicator on CUDA tensors: the item ``comm_gloo_cuda``.

Two gloo ranks share GPU 0 (gloo moves CUDA tensors through host memory, so one GPU suffices).
Each case of ``COMM_CASES`` (``gpu_check/lineup.py``'s ``GPU_CHECK``: allreduce, ddp, lazy, lazy
with the fp16 wire, csc, gradientflow) runs a few steps of ``SmallNet`` and must hold the
communicator's invariant against the ranks' own gradients: p.grad is the mean gradient (dense
strategies), or p.grad plus the mean of the CSC residuals is the mean of what each rank
accumulated. Then an inf in one rank's gradient must reach both ranks (so that the agreed overflow
check skips the step). ``PARITY_CASES`` run the full stack
under timm's Lars on the device against the same run on the CPU.

The test suite runs the same item on CPU tensors (``check_communicators_on_cpu``).
"""

from __future__ import annotations

import copy
import datetime
import functools
import json
import os
import statistics
import sys
import time
import traceback
from typing import Any, Optional

import torch

from gradientflow_repro import variants
from gradientflow_repro.gpu_check.devices import collective_device, synchronize
from gradientflow_repro.gpu_check.hooks import stale_pool
from gradientflow_repro.gpu_check.lineup import GPU_CHECK
from gradientflow_repro.gpu_check.processes import REPORTED_EXIT, put_result, spawn_ranks, time_left
from gradientflow_repro.gpu_check.results import Reporter, Result, Skip, describe, project_imports

# (label, comm options): gpu_check/lineup.py's GPU_CHECK, each over the check's own sizes.
# Presets whose algorithm is the ring run with algorithm=builtin (gloo has no send/recv of CUDA
# tensors), with pool parts of about 1 KiB so that the small model fills several.
POOL = {"algorithm": "builtin", "bucket_mb": 0.001}
CSC_KNOBS = {**POOL, "density": 0.1, "csc_warmup_epochs": 0.0, "chunk_size": 64}
SIZES_BY_STRATEGY = {"lazy": POOL, "csc": CSC_KNOBS, "gradientflow": CSC_KNOBS}
COMM_CASES: list[tuple[str, dict[str, Any]]] = [
    (label, {**options, **SIZES_BY_STRATEGY.get(options["strategy"], {})})
    for label, options in variants.options_of(GPU_CHECK).items()]
COMM_STEPS = 4
# The stack under LARS with momentum correction on the device against the same run on the CPU (the
# path the test suite checks; `comm=gradientflow` itself runs without the correction, its case above):
# momentum correction with LARS's ratio, the ratio's noise sketches (world > 1), a loss scale. Its
# invariant is not the plain mean (the velocity is what is summed), so the CPU run is the
# reference; rounding differs between devices, hence a tolerance.
# fp32 wire: the two devices' fp16 wires round differently (the device agrees on one scale, the host
# scales each message itself), and what the fp16 wire does is checked above; with fp32 the runs
# differ only by float rounding, so chunk choices do not flip and the tolerance can be tight.
PARITY_CASES: list[tuple[str, dict[str, Any]]] = [
    ("gradientflow-mc+lars vs cpu", {"strategy": "gradientflow", **CSC_KNOBS, "wire": "fp32",
                                     "momentum_correction": True, "momentum_masking": True})]
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


def residuals(comm: Any, params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
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


def same_message(comm: Any, params: list[torch.nn.Parameter]) -> list[list[int]]:
    """For each parameter, the parameters sent in the same message: its pool part, or itself."""
    index = {id(p): i for i, p in enumerate(params)}
    together = [[i] for i in range(len(params))]
    for bucket in getattr(comm, "buckets", []):
        members = [index[id(p)] for p in bucket.params]
        for i in members:
            together[i] = members
    return together


def _check_communicator(options: dict[str, Any], rank: int, world: int, device: torch.device) -> dict[str, Any]:
    """One communicator through COMM_STEPS steps and an overflow step; this rank's findings.

    Per step, with this rank's gradient g_r (from a plain copy of the model) and CSC residuals
    before (old_r) and after (new_r) the step: p.grad + mean_r(new_r) must equal mean_r(old_r + g_r)
    (dense strategies have no residual, so p.grad must be the mean gradient)."""
    import torch.distributed as dist

    from gradientflow_repro.comm.factory import build_communicator
    from gradientflow_repro.comm.plan import resolve

    fp16 = resolve(options).wire == "fp16"
    torch.manual_seed(0)
    model = SmallNet().to(device)
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # momentum 0: CSC's velocity is the gradient
    comm = build_communicator(options, device)
    module = comm.attach(model, optimizer)
    stale_pool(comm)
    params = list(model.parameters())
    message = same_message(comm, params)
    worst, step_ms, problems = 0.0, [], []
    for step in range(COMM_STEPS):
        x = torch.randn(16, 37, generator=torch.Generator().manual_seed(100 * rank + step)).to(device)
        reference.zero_grad(set_to_none=True)
        reference(x).pow(2).mean().backward()
        local = [p.grad for p in reference.parameters()]
        old = residuals(comm, params)
        synchronize(device)
        started = time.perf_counter()
        comm.begin_step(float(step), 1.0)
        module(x).pow(2).mean().backward()
        comm.synchronize()
        synchronize(device)
        step_ms.append((time.perf_counter() - started) * 1e3)
        synced = [p.grad.detach().float().cpu() for p in params]
        comm.end_step(applied=True)
        model.zero_grad(set_to_none=True)
        ranks = _gather_cpu([*local, *old, *residuals(comm, params)], world)
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
    synchronize(device)
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
    """The verdict and detail of a parity case from every rank's findings (``_check_parity``)."""
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
    """The verdict and detail of a communicator case from every rank's findings (``_check_communicator``)."""
    from gradientflow_repro.comm.knobs import presets
    from gradientflow_repro.comm.plan import resolve

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


def check_communicators(report: Reporter, device_type: Optional[str] = None) -> None:
    """The item ``comm_gloo_cuda``: two spawned gloo ranks on ``device_type`` tensors (CUDA, or the CPU
    under the test device), each running every case."""
    device_type = device_type or collective_device(0).type
    with project_imports():
        import gradientflow_repro.comm.factory  # noqa: F401 - fail here, not in both ranks
    spawn_ranks(report, functools.partial(_comm_rank, device_type=device_type), 2, max(5.0, time_left() - 5))


def check_communicators_on_cpu(report: Reporter) -> None:
    """The same item on CPU tensors: how the test suite checks the item itself without a GPU."""
    check_communicators(report, device_type="cpu")

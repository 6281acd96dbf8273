"""Rank workers that several communication test modules run, and the small models they train.

Each ``check_*`` worker runs in every gloo process of a ``conftest.spawn``: it drives one strategy
for a few steps, checks it against ``dist.all_reduce`` of every rank's own data, and saves its
failures to ``<out>/rank<r>.pt`` for ``conftest.assert_no_failures`` (the ring's DDP-hook worker
saves True or False). They live here, not in a test module, because the same check runs plainly
(test_comm_every_strategy, test_comm_collectives, test_comm_csc), with the process group claiming
to be NCCL (test_comm_backend) and under NCCL's ordering rules (test_nccl_order).
"""

from __future__ import annotations

import copy
import io
import math
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from gradientflow_repro.comm import build_communicator
from gradientflow_repro.comm.csc import CSCCommunicator
from gradientflow_repro.comm.lazy import LazyAllreduce
from gradientflow_repro.comm.plan import resolve
from gradientflow_repro.comm.ring import ring_sum

from conftest import save_failures

CPU = torch.device("cpu")


# ---------------------------------------------------------------- every strategy against all_reduce
# the check of test_comm_every_strategy (its docstring states the identity), on ThreeLayerNet

STEPS = 4  # csc_hook's first iteration is always dense: three sparse ones follow
Pieces = list[tuple[list[nn.Parameter], list[int], Optional[torch.Tensor]]]  # params, offsets, residual


class ThreeLayerNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(37, 53)  # 1961 + 53
        self.b = nn.Linear(53, 29)  # 1537 + 29
        self.c = nn.Linear(29, 11)  # 319 + 11
        self.norm = nn.BatchNorm1d(11)  # 1-D: always sent densely by CSC

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.c(torch.relu(self.b(torch.relu(self.a(x))))))


def strategy_options(name: str, world: int) -> dict:
    options = {"strategy": name, "bucket_mb": 0.004, "ddp_bucket_mb": 0.004, "segment_kb": 1,
               "chunk_size": 100, "density": 0.3, "csc_warmup_epochs": 0}
    if name == "hierarchical":
        options["ranks_per_node"] = 2 if world % 2 == 0 else 1  # world 4: two nodes of two
    return options


def rank_batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(8, 37, generator=torch.Generator().manual_seed(100 * rank + step))


def flat_concat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).float() for t in tensors])


def residual_per_param(params: list[nn.Parameter], pieces: Pieces) -> list[torch.Tensor]:
    """Each parameter's share of the residuals (copies: the state changes in the next step)."""
    by_param = {id(p): torch.zeros_like(p) for p in params}
    for members, offsets, residual in pieces:
        if residual is None:
            continue
        flat = residual.reshape(-1)
        for param, offset in zip(members, offsets):
            if offset + param.numel() <= flat.numel():  # past the chunks: a dense tail, no residual
                by_param[id(param)] = flat[offset:offset + param.numel()].view_as(param).clone()
    return [by_param[id(p)] for p in params]


def check_step(step: int, world: int, params: list[nn.Parameter], groups: list[list[int]],
                local: list[torch.Tensor], old: list[torch.Tensor], new: list[torch.Tensor],
                fp16: bool) -> list[str]:
    """world * p.grad + sum new_r == sum (old_r + g_r), parameter by parameter; same p.grad everywhere.
    ``groups[i]``: the parameters sent in the same message as parameter i (the fp16 wire's scale)."""
    failures, sizes = [], [p.numel() for p in params]
    mine = flat_concat([p.grad for p in params])
    highest, lowest = mine.clone(), mine.clone()
    dist.all_reduce(highest, op=dist.ReduceOp.MAX)
    dist.all_reduce(lowest, op=dist.ReduceOp.MIN)
    if not torch.equal(highest, lowest):
        failures.append(f"step {step}: ranks hold different gradients ({(highest - lowest).abs().max():.3g})")
    accumulated = [o + g for o, g in zip(old, local)]
    peaks = torch.stack([a.abs().max() for a in accumulated])
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
    expected, held = flat_concat(accumulated), flat_concat(new)
    dist.all_reduce(expected)
    dist.all_reduce(held)
    got = (mine * world + held).split(sizes)
    for i, (param_got, param_expected) in enumerate(zip(got, expected.split(sizes))):
        error = (param_got - param_expected).abs().max().item()
        if fp16:  # each rank's message is rounded to fp16 relative to its largest value; PyTorch's
            # fp16_compress_hook has no scale, so values below fp16's subnormal spacing (2^-24) round away
            bound = 2e-3 * world * max(peaks[j].item() for j in groups[i]) + world * world * 2.0**-23
        else:
            bound = 1e-5 * peaks[i].item() + 1e-5 * param_expected.abs().max().item()
        if not error <= bound:
            failures.append(f"step {step}: parameter {i} {tuple(params[i].shape)}: world * grad + "
                            f"residuals differs from the sum of gradients by {error:.3g} (bound {bound:.3g})")
    return failures


def same_chunks_everywhere(step: int, selection: dict[int, torch.Tensor], world: int) -> list[str]:
    seen: list = [None] * world
    dist.all_gather_object(seen, {int(k): v.tolist() for k, v in selection.items()})
    return [] if all(s == seen[0] for s in seen) else [f"step {step}: ranks chose different chunks {seen}"]


def run_checked_steps(rank: int, world: int, model: nn.Module, reference: nn.Module, module: nn.Module,
         step_hooks: dict[str, Callable], groups: list[list[int]], fp16: bool) -> list[str]:
    """STEPS steps through ``module`` (``model`` as the communicator returned it), each checked;
    ``reference``: a plain copy of ``model``, for this rank's own gradient. ``step_hooks``:
    begin(step), end(), pieces(), selection() (None for dense)."""
    params = list(model.parameters())
    failures = []
    for step in range(STEPS):
        x = rank_batch(rank, step)
        reference.zero_grad(set_to_none=True)
        reference(x).pow(2).mean().backward()
        local = [p.grad.clone() for p in reference.parameters()]
        old = residual_per_param(params, step_hooks["pieces"]())
        step_hooks["begin"](step)
        module(x).pow(2).mean().backward()
        step_hooks["end"]()  # synchronize(), end_step(applied=True): the communication thread is done
        new = residual_per_param(params, step_hooks["pieces"]())
        failures += check_step(step, world, params, groups, local, old, new, fp16)
        selection = step_hooks["selection"]()
        if selection is not None:
            failures += same_chunks_everywhere(step, selection, world)
        model.zero_grad(set_to_none=True)
    return failures


def check_strategy(rank: int, world: int, out: str, options: dict) -> None:
    model = ThreeLayerNet()
    reference = copy.deepcopy(model)  # before attach registers hooks on the parameters
    comm = build_communicator(options, CPU)
    module = comm.attach(model)
    params = list(model.parameters())
    buckets = getattr(comm, "buckets", None)
    groups = [[i] for i in range(len(params))]
    for bucket in buckets or []:  # the pool: one message per part
        members = [next(j for j, p in enumerate(params) if p is q) for q in bucket.params]
        for i in members:
            groups[i] = members
    sparse = isinstance(comm, CSCCommunicator)
    powersgd = resolve(options).sparsity == "powersgd"

    def begin(step: int) -> None:
        comm.begin_step(float(step))

    def end() -> None:
        comm.synchronize()
        comm.end_step(applied=True)

    def pieces() -> Pieces:
        if powersgd:  # its error feedback holds back what its low-rank factors missed, per DDP bucket
            hook = comm.hook_state
            if hook is None:
                return []
            found = []
            for index, error in hook.torch_state.error_dict.items():
                members = [params[j] for j in hook.layouts[index]]
                offsets = [sum(p.numel() for p in members[:k]) for k in range(len(members))]
                found.append((members, offsets, error))
            return found
        if not sparse:
            return []
        return [(b.params, b.offsets, comm.residual.get(i)) for i, b in enumerate(buckets)]

    hooks = {"begin": begin, "end": end, "pieces": pieces,
             "selection": (lambda: comm.last_selection) if sparse else (lambda: None)}
    failures = run_checked_steps(rank, world, model, reference, module, hooks, groups,
                    fp16=resolve(options).wire == "fp16")
    if sparse:
        if not comm.density_now < 1:
            failures.append(f"density {comm.density_now}: nothing was sparsified")
        if not any(r.abs().sum() > 0 for r in comm.residual.values()):
            failures.append("the residuals are empty: nothing was held back")
        configured = resolve(options).keys.release_cap
        if comm.release_cap != configured:
            failures.append(f"release cap {comm.release_cap}, not the configuration's {configured}")
    if powersgd and world > 1 and not (comm.hook_state and comm.hook_state.torch_state.error_dict):
        failures.append("powersgd never compressed: no error feedback held")
    comm.close()
    save_failures(failures, out, rank)


# ---------------------------------------------------------------- the lazy pool; the ring as a DDP hook

SIZES = [1, 7, 4099, 1_000_003]


def local_tensor(size: int, dtype: torch.dtype, rank: int, salt: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * rank + size + salt)
    return torch.randn(size, generator=generator).to(dtype)


class Leaves(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tensors = nn.ParameterList([nn.Parameter(torch.zeros(n)) for n in SIZES])
        self.unused = nn.Parameter(torch.zeros(5))


def check_lazy_pool(rank: int, world: int, out: str, overlap: bool) -> None:
    model = Leaves()
    pool = LazyAllreduce(torch.device("cpu"), ring_sum(segment_bytes=8192), bucket_bytes=16 * 1024,
                         overlap=overlap)
    pool.attach(model)
    failures = []
    for step in range(3):
        weights = [local_tensor(p.numel(), torch.float32, rank, salt=step) for p in model.tensors]
        # hooks fire in a rank-dependent order: the pool must still send parts in one order
        order = torch.randperm(len(weights), generator=torch.Generator().manual_seed(rank + 10 * step))
        loss = sum((model.tensors[i] * weights[i]).sum() for i in order.tolist())
        if rank == 0 and step == 1:  # a parameter used on one rank only, in one step
            loss = loss + model.unused.sum()
        loss.backward()
        pool.synchronize()
        for param, local in zip(model.tensors, weights):
            dist.all_reduce(local)
            if not torch.allclose(param.grad, local / world, rtol=1e-5, atol=1e-6):
                failures.append(f"step {step}: size {param.numel()} differs")
        expected_unused = (1.0 / world) if step == 1 else 0.0
        if model.unused.grad is None or not torch.allclose(model.unused.grad, torch.full((5,), expected_unused)):
            failures.append(f"step {step}: unused parameter got {model.unused.grad}")
        model.zero_grad(set_to_none=True)
    if len(pool.buckets) < 3:
        failures.append(f"only {len(pool.buckets)} pool parts: the threshold was not applied")
    pool.close()
    save_failures(failures, out, rank)


def check_ddp_ring_hook(rank: int, world: int, out: str) -> None:
    from torch.nn.parallel import DistributedDataParallel

    from gradientflow_repro.comm.hooks import SumHookState, sum_hook

    torch.manual_seed(0)
    model = nn.Linear(33, 7)
    reference = nn.Linear(33, 7)
    reference.load_state_dict(model.state_dict())
    ddp = DistributedDataParallel(model)
    state = SumHookState(ring_sum(segment_bytes=256))
    ddp.register_comm_hook(state, sum_hook)
    x = torch.randn(5, 33, generator=torch.Generator().manual_seed(rank))
    ddp(x).pow(2).sum().backward()
    reference(x).pow(2).sum().backward()
    expected = reference.weight.grad.clone()
    dist.all_reduce(expected)
    ok = torch.allclose(model.weight.grad, expected / world, rtol=1e-5, atol=1e-6) and state.stats.bytes > 0
    torch.save(ok, Path(out) / f"rank{rank}.pt")


# ---------------------------------------------------------------- coarse-grained sparse communication

class TwoLayerNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(37, 53)  # 1961 + 53
        self.b = nn.Linear(53, 11)  # 583 + 11
        self.norm = nn.BatchNorm1d(11)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.b(torch.relu(self.a(x))))


def csc(density: float, momentum_correction: bool = False, overlap: bool = True,
        density_ramp_epochs: int = 0, release_cap: float = 0.0) -> CSCCommunicator:
    return CSCCommunicator(CPU, ring_sum(segment_bytes=1024), bucket_bytes=4096, overlap=overlap,
                           chunk_size=100, density=density, warmup_epochs=0.0,
                           momentum_correction=momentum_correction, density_ramp_epochs=density_ramp_epochs,
                           release_cap=release_cap)


def backward(model: nn.Module, rank: int, step: int) -> None:
    x = torch.randn(8, 37, generator=torch.Generator().manual_seed(rank * 100 + step))
    model(x).pow(2).mean().backward()


def pool_layout(bucket, tensors: list[torch.Tensor]) -> torch.Tensor:
    """``tensors`` laid out as in the pool part (zero padding included)."""
    flat = torch.zeros_like(bucket.flat)
    for tensor, offset in zip(tensors, bucket.offsets):
        flat[offset:offset + tensor.numel()] = tensor.reshape(-1)
    return flat


def check_csc_selection_and_no_loss(rank: int, world: int, out: str, release_cap: float = 0.0) -> None:
    model = TwoLayerNet()
    comm = csc(density=0.3, density_ramp_epochs=2, release_cap=release_cap)  # densities 0.67, 0.45, then 0.3
    # what this rank produced, taken as autograd finishes each gradient: from then on p.grad is a
    # view of the pool, which the communication thread sums in place (hooks run in the order they
    # were registered, so these run before the pool's)
    produced_now: dict = {}
    for param in model.parameters():
        param.register_post_accumulate_grad_hook(lambda p: produced_now.__setitem__(p, p.grad.detach().clone()))
    comm.attach(model)
    sent_total = [torch.zeros_like(b.flat) for b in comm.buckets]
    grad_total = [torch.zeros_like(b.flat) for b in comm.buckets]
    failures = []
    for step in range(5):
        comm.begin_step(epoch=float(step))
        backward(model, rank, step)
        # what this rank produced, in pool layout (reduced only after synchronize(): while the
        # communication thread runs, no other collective may be issued)
        produced = [pool_layout(bucket, [produced_now[p] for p in bucket.params]) for bucket in comm.buckets]
        comm.synchronize()
        for i, local in enumerate(produced):
            dist.all_reduce(local)
            grad_total[i] += local
        comm.end_step(applied=True)
        for i, bucket in enumerate(comm.buckets):
            sent_total[i] += pool_layout(bucket, [p.grad for p in bucket.params]) * world
        selections = [None] * world
        dist.all_gather_object(selections, {k: v.tolist() for k, v in comm.last_selection.items()})
        if any(s != selections[0] for s in selections):
            failures.append(f"step {step}: ranks chose different chunks {selections}")
        if not comm.last_selection:
            failures.append("nothing was sparsified")
        for i, chosen in comm.last_selection.items():
            chunks = comm.chunks(comm.buckets[i]).shape[0]
            if len(chosen) != math.ceil(0.3 ** (min(step + 1, 3) / 3) * chunks):
                failures.append(f"step {step}: part {i} sent {len(chosen)} of {chunks} chunks at "
                                f"density {comm.density_now:.3f}")
        model.zero_grad(set_to_none=True)
    for i, bucket in enumerate(comm.buckets):
        held_back = torch.zeros_like(bucket.flat)  # the residual covers the part's chunks, not its dense tail
        if i in comm.residual:
            held_back[:bucket.sparse_elements] = comm.residual[i].reshape(-1)
        dist.all_reduce(held_back)
        if not torch.allclose(sent_total[i] + held_back, grad_total[i], rtol=1e-5, atol=1e-5):
            failures.append(f"part {i}: sent + residual != gradients "
                            f"({(sent_total[i] + held_back - grad_total[i]).abs().max():.3g})")
    if not any(r.abs().sum() > 0 for r in comm.residual.values()):
        failures.append("residuals are empty: density < 1 held nothing back")
    capped = any(comm.residual[i][chosen].abs().sum() > 0 for i, chosen in comm.last_selection.items())
    if capped != (release_cap > 0):  # without a cap the chunks just sent are cleared; with it some are held
        failures.append(f"release cap {release_cap}: chunks just sent {'kept' if capped else 'cleared'} residual")
    comm.close()
    save_failures(failures, out, rank)


def check_ddp_csc_hook(rank: int, world: int, out: str) -> None:
    from torch.nn.parallel import DistributedDataParallel

    from gradientflow_repro.comm.hooks import CSCHookState, csc_hook

    model, reference = TwoLayerNet(), TwoLayerNet()
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.004)
    state = CSCHookState(density=0.3, chunk_size=100, dense_steps=1, sum_fn=ring_sum(segment_bytes=1024))
    layouts: dict[int, list[nn.Parameter]] = {}

    def recording_hook(hook_state, bucket):  # which parameters each bucket holds, for the check
        layouts[bucket.index()] = bucket.parameters()
        return csc_hook(hook_state, bucket)

    ddp.register_comm_hook(state, recording_hook)
    names = {p: name for name, p in model.named_parameters()}
    sent = {name: torch.zeros_like(p) for name, p in model.named_parameters()}
    produced = {name: torch.zeros_like(p) for name, p in model.named_parameters()}
    failures, overflow_step = [], 3
    for step in range(6):
        x = torch.randn(8, 37, generator=torch.Generator().manual_seed(rank * 100 + step))
        scale = float("inf") if (step == overflow_step and rank == 0) else 1.0
        before = {i: r.clone() for i, r in state.residual.items()}
        ddp(x).pow(2).mean().mul(scale).backward()
        reference(x).pow(2).mean().backward()
        local = {name: p.grad.clone() for name, p in reference.named_parameters()}
        for tensor in local.values():
            dist.all_reduce(tensor)
        if step == overflow_step:  # one rank overflowed: every rank sees it, residuals stay as they were
            if all(torch.isfinite(p.grad).all() for p in model.parameters()):
                failures.append("an overflow on rank 0 did not reach every rank")
            if any(not torch.equal(before[i], state.residual[i]) for i in before):
                failures.append("the overflowing step changed a residual")
        else:
            for name, p in model.named_parameters():
                sent[name] += p.grad * world
                produced[name] += local[name]
                if (step == 0 or p.ndim == 1) and not torch.allclose(p.grad, local[name] / world, atol=1e-6):
                    failures.append(f"step {step}: {name} was not averaged densely")
            selections = [None] * world
            dist.all_gather_object(selections, {k: v.tolist() for k, v in state.last_selection.items()})
            if any(s != selections[0] for s in selections):
                failures.append(f"step {step}: ranks chose different chunks")
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
    if not state.residual or not any(r.abs().sum() > 0 for r in state.residual.values()):
        failures.append("nothing was held back")
    for index, params in layouts.items():  # sent + what all residuals hold = every gradient produced
        residual = state.residual[index].reshape(-1).clone()
        dist.all_reduce(residual)
        offset = 0
        for p in params:
            name = names[p]
            held = residual[offset:offset + p.numel()].view_as(p)
            if not torch.allclose(sent[name] + held, produced[name], rtol=1e-5, atol=1e-5):
                failures.append(f"{name}: sent + residual != gradients "
                                f"({(sent[name] + held - produced[name]).abs().max():.3g})")
            offset += p.numel()
    saved = io.BytesIO()
    torch.save(state.state_dict(), saved)
    restored = CSCHookState(density=0.3, chunk_size=100)
    restored.load_state_dict(torch.load(io.BytesIO(saved.getvalue())))
    if restored.iteration != 6 or any(not torch.equal(restored.residual[i], r) for i, r in state.residual.items()):
        failures.append("state_dict did not restore the residuals exactly")
    save_failures(failures, out, rank)

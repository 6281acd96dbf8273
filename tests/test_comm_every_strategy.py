"""Every communication strategy and both DDP hooks against ``dist.all_reduce``, in real gloo processes.

Each preset of ``gradientflow_repro.comm.STRATEGIES`` is built by ``build_communicator`` with tiny
pool parts, DDP buckets, ring segments and CSC chunks (so a small model with odd tensor sizes spans
several messages and many chunks), and ``sum_hook`` (ring) and ``csc_hook`` are registered on a
real DDP model. A few steps run at world sizes 2 and 3 (hierarchical also at 4: two nodes of two).
After every step, with g_r rank r's own gradient (from a plain copy of the model) and old_r / new_r
its residual before / after the step (zero for dense strategies), this must hold:

    world * p.grad + sum_r new_r == sum_r (old_r + g_r)

Dense strategies thus deliver the ``all_reduce`` mean; sparse ones deliver what they sent while the
ranks' residuals hold the rest, so no gradient is lost. The tolerance is fp32 rounding, or for the
fp16 wire its rounding relative to the largest value of the message. Every rank must hold the same
``p.grad``, and sparse strategies must really hold something back and choose the same chunks on
every rank (else the check would say little).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Callable, Optional

import pytest
import torch
import torch.distributed as dist
from torch import nn

from gradientflow_repro.comm import STRATEGIES, build_communicator
from gradientflow_repro.comm.compression import Fp16Wire
from gradientflow_repro.comm.csc import CSCCommunicator
from gradientflow_repro.comm.hooks import CSCHookState, SumHookState, csc_hook, sum_hook
from gradientflow_repro.comm.knobs import resolve
from gradientflow_repro.comm.ring import ring_sum

from conftest import assert_no_failures, spawn

CPU = torch.device("cpu")
STEPS = 4  # csc_hook's first iteration is always dense: three sparse ones follow
Pieces = list[tuple[list[nn.Parameter], list[int], Optional[torch.Tensor]]]  # params, offsets, residual


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(37, 53)  # 1961 + 53
        self.b = nn.Linear(53, 29)  # 1537 + 29
        self.c = nn.Linear(29, 11)  # 319 + 11
        self.norm = nn.BatchNorm1d(11)  # 1-D: always sent densely by CSC

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.c(torch.relu(self.b(torch.relu(self.a(x))))))


def _options(name: str, world: int) -> dict:
    options = {"strategy": name, "bucket_mb": 0.004, "ddp_bucket_mb": 0.004, "segment_kb": 1,
               "chunk_size": 100, "density": 0.3, "csc_warmup_epochs": 0}
    if name == "hierarchical":
        options["ranks_per_node"] = 2 if world % 2 == 0 else 1  # world 4: two nodes of two
    return options


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(8, 37, generator=torch.Generator().manual_seed(100 * rank + step))


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).float() for t in tensors])


def _residual_per_param(params: list[nn.Parameter], pieces: Pieces) -> list[torch.Tensor]:
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


def _check_step(step: int, world: int, params: list[nn.Parameter], groups: list[list[int]],
                local: list[torch.Tensor], old: list[torch.Tensor], new: list[torch.Tensor],
                fp16: bool) -> list[str]:
    """world * p.grad + sum new_r == sum (old_r + g_r), parameter by parameter; same p.grad everywhere.
    ``groups[i]``: the parameters sent in the same message as parameter i (the fp16 wire's scale)."""
    failures, sizes = [], [p.numel() for p in params]
    mine = _flat([p.grad for p in params])
    highest, lowest = mine.clone(), mine.clone()
    dist.all_reduce(highest, op=dist.ReduceOp.MAX)
    dist.all_reduce(lowest, op=dist.ReduceOp.MIN)
    if not torch.equal(highest, lowest):
        failures.append(f"step {step}: ranks hold different gradients ({(highest - lowest).abs().max():.3g})")
    accumulated = [o + g for o, g in zip(old, local)]
    peaks = torch.stack([a.abs().max() for a in accumulated])
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
    expected, held = _flat(accumulated), _flat(new)
    dist.all_reduce(expected)
    dist.all_reduce(held)
    got = (mine * world + held).split(sizes)
    for i, (param_got, param_expected) in enumerate(zip(got, expected.split(sizes))):
        error = (param_got - param_expected).abs().max().item()
        if fp16:  # each rank's message is rounded to fp16 relative to its largest value
            bound = 2e-3 * world * max(peaks[j].item() for j in groups[i])
        else:
            bound = 1e-5 * peaks[i].item() + 1e-5 * param_expected.abs().max().item()
        if not error <= bound:
            failures.append(f"step {step}: parameter {i} {tuple(params[i].shape)}: world * grad + "
                            f"residuals differs from the sum of gradients by {error:.3g} (bound {bound:.3g})")
    return failures


def _same_everywhere(step: int, selection: dict[int, torch.Tensor], world: int) -> list[str]:
    seen: list = [None] * world
    dist.all_gather_object(seen, {int(k): v.tolist() for k, v in selection.items()})
    return [] if all(s == seen[0] for s in seen) else [f"step {step}: ranks chose different chunks {seen}"]


def _run(rank: int, world: int, model: nn.Module, reference: nn.Module, module: nn.Module,
         step_hooks: dict[str, Callable], groups: list[list[int]], fp16: bool) -> list[str]:
    """STEPS steps through ``module`` (``model`` as the communicator returned it), each checked;
    ``reference``: a plain copy of ``model``, for this rank's own gradient. ``step_hooks``:
    begin(step), end(), pieces(), selection() (None for dense)."""
    params = list(model.parameters())
    failures = []
    for step in range(STEPS):
        x = _batch(rank, step)
        reference.zero_grad(set_to_none=True)
        reference(x).pow(2).mean().backward()
        local = [p.grad.clone() for p in reference.parameters()]
        old = _residual_per_param(params, step_hooks["pieces"]())
        step_hooks["begin"](step)
        module(x).pow(2).mean().backward()
        step_hooks["end"]()  # synchronize(), end_step(applied=True): the communication thread is done
        new = _residual_per_param(params, step_hooks["pieces"]())
        failures += _check_step(step, world, params, groups, local, old, new, fp16)
        selection = step_hooks["selection"]()
        if selection is not None:
            failures += _same_everywhere(step, selection, world)
        model.zero_grad(set_to_none=True)
    return failures


def _strategy(rank: int, world: int, out: str, options: dict) -> None:
    model = Net()
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

    def begin(step: int) -> None:
        comm.begin_step(float(step))

    def end() -> None:
        comm.synchronize()
        comm.end_step(applied=True)

    def pieces() -> Pieces:
        if not sparse:
            return []
        return [(b.params, b.offsets, comm.residual.get(i)) for i, b in enumerate(buckets)]

    hooks = {"begin": begin, "end": end, "pieces": pieces,
             "selection": (lambda: comm.last_selection) if sparse else (lambda: None)}
    failures = _run(rank, world, model, reference, module, hooks, groups,
                    fp16=isinstance(getattr(comm, "sum_fn", None), Fp16Wire))
    if sparse:
        if not comm.density_now < 1:
            failures.append(f"density {comm.density_now}: nothing was sparsified")
        if not any(r.abs().sum() > 0 for r in comm.residual.values()):
            failures.append("the residuals are empty: nothing was held back")
        if comm.release_cap != resolve(options).release_cap:
            failures.append(f"release cap {comm.release_cap}, not the configuration's {resolve(options).release_cap}")
    comm.close()
    torch.save(failures, Path(out) / f"rank{rank}.pt")


def _hook(rank: int, world: int, out: str, name: str) -> None:
    from torch.nn.parallel import DistributedDataParallel

    model = Net()
    reference = copy.deepcopy(model)
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.004)
    if name == "sum_hook":
        state, hook = SumHookState(ring_sum(segment_bytes=1024)), sum_hook
    else:
        state, hook = CSCHookState(density=0.3, chunk_size=100, dense_steps=1,
                                   sum_fn=ring_sum(segment_bytes=1024)), csc_hook
    layouts: dict[int, list[nn.Parameter]] = {}

    def recording_hook(hook_state, bucket):  # which parameters each bucket holds, in buffer order
        layouts[bucket.index()] = list(bucket.parameters())
        return hook(hook_state, bucket)

    ddp.register_comm_hook(state, recording_hook)
    sparse = isinstance(state, CSCHookState)

    def pieces() -> Pieces:
        if not sparse:
            return []
        found = []
        for index, residual in state.residual.items():
            members = layouts[index]
            offsets = [sum(p.numel() for p in members[:k]) for k in range(len(members))]
            found.append((members, offsets, residual))
        return found

    hooks = {"begin": lambda step: None, "end": lambda: None, "pieces": pieces,
             "selection": (lambda: state.last_selection) if sparse else (lambda: None)}
    params = list(model.parameters())
    failures = _run(rank, world, model, reference, ddp, hooks, [[i] for i in range(len(params))], fp16=False)
    if sparse and not any(r.abs().sum() > 0 for r in state.residual.values()):
        failures.append("the residuals are empty: nothing was held back")
    if state.stats.bytes <= 0:
        failures.append("the hook counted no bytes")
    torch.save(failures, Path(out) / f"rank{rank}.pt")


HOOKS = ("sum_hook", "csc_hook")
# the paper's layers on top of the backend's own allreduce (a cluster user's NCCL), and `auto` on
# two emulated nodes of two ranks (the two-level ring under the full stack)
COMBINATIONS = {"gradientflow+builtin": {"strategy": "gradientflow", "algorithm": "builtin"},
                "csc+builtin+fp16": {"strategy": "csc", "algorithm": "builtin", "wire": "fp16"},
                "lazy+builtin+fp16": {"strategy": "lazy", "algorithm": "builtin", "wire": "fp16"},
                "gradientflow+auto-2x2": {"strategy": "gradientflow", "ranks_per_node": 2}}
CASES = [*((name, world) for name in STRATEGIES
           for world in ((2, 3, 4) if name == "hierarchical" else (2, 3))),
         *((hook, world) for hook in HOOKS for world in (2, 3)),
         ("gradientflow+builtin", 2), ("gradientflow+builtin", 3), ("csc+builtin+fp16", 3),
         ("lazy+builtin+fp16", 3), ("gradientflow+auto-2x2", 4),
         ("gradientflow+auto-2x2", 3)]  # world 3: nodes of two and one


@pytest.mark.parametrize("name,world", CASES, ids=[f"{n}-world{w}" for n, w in CASES])
def test_every_strategy_and_hook_against_all_reduce(name: str, world: int, tmp_path: Path) -> None:
    if name in HOOKS:
        spawn(_hook, world, str(tmp_path), name)
    elif name in COMBINATIONS:
        spawn(_strategy, world, str(tmp_path), {**_options(COMBINATIONS[name]["strategy"], world),
                                                **COMBINATIONS[name]})
    else:
        spawn(_strategy, world, str(tmp_path), _options(name, world))
    assert_no_failures(tmp_path, world)


def _chosen_algorithm(rank: int, world: int, out: str) -> None:
    """What `comm=gradientflow` sums with, by the launcher's ranks per node."""
    from gradientflow_repro.comm.hierarchical import HierarchicalSum

    found = {}
    for per_node in (None, 1, 2, 4):
        comm = build_communicator({"strategy": "gradientflow"}, CPU, ranks_per_node=per_node,
                                  local_rank=None if per_node is None else rank % per_node)
        large = comm.sum_fn.inner.large  # inside the fp16 wire: small messages by recursive doubling
        found[per_node] = (comm.summing, isinstance(large, HierarchicalSum))
    torch.save(found, Path(out) / f"rank{rank}.pt")


def test_gradientflow_is_two_level_on_several_nodes_of_several_ranks(tmp_path: Path) -> None:
    spawn(_chosen_algorithm, 4, str(tmp_path))
    found = torch.load(tmp_path / "rank0.pt")
    assert found[2] == ("two-level ring (2 nodes x 2 ranks), small messages (up to 1024 KiB) by recursive "
                        "doubling, fp16 wire", True)
    for flat in (None, 1, 4):  # no launcher figure, one rank per node, or one node
        assert found[flat] == ("flat ring over 4 ranks, small messages (up to 1024 KiB) by recursive doubling, "
                               "fp16 wire", False)

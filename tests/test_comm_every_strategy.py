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

import pytest
import torch
from torch import nn

from gradientflow_repro.comm import STRATEGIES, build_communicator
from gradientflow_repro.comm.hooks import CSCHookState, SumHookState, csc_hook, sum_hook
from gradientflow_repro.comm.ring import ring_sum

from comm_workers import CPU, Pieces, ThreeLayerNet, check_strategy, run_checked_steps, strategy_options
from conftest import assert_no_failures, save_failures, spawn


def _hook(rank: int, world: int, out: str, name: str) -> None:
    from torch.nn.parallel import DistributedDataParallel

    model = ThreeLayerNet()
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
    failures = run_checked_steps(rank, world, model, reference, ddp, hooks, [[i] for i in range(len(params))],
                                 fp16=False)
    if sparse and not any(r.abs().sum() > 0 for r in state.residual.values()):
        failures.append("the residuals are empty: nothing was held back")
    if state.stats.bytes <= 0:
        failures.append("the hook counted no bytes")
    save_failures(failures, out, rank)


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
        spawn(check_strategy, world, str(tmp_path), {**strategy_options(COMBINATIONS[name]["strategy"], world),
                                                **COMBINATIONS[name]})
    else:
        spawn(check_strategy, world, str(tmp_path), strategy_options(name, world))
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

"""Every strategy built on point-to-point ops completes under NCCL's ordering rules (one stream per
process group, ops in issue order, a send waits for its receiver; see ``nccl_order.py``) and still
matches ``dist.all_reduce``: the ring, hierarchical, fp16 wire, lazy pool, CSC and both DDP hooks,
at world sizes 2, 3 and 4, and recursive doubling (with its fold) at 3 and 4. And the double itself
catches the deadlock it exists for."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from gradientflow_repro.comm.base import CommStats
from gradientflow_repro.comm.compression import Fp16Wire
from gradientflow_repro.comm.hierarchical import HierarchicalSum
from gradientflow_repro.comm.recursive_doubling import recursive_doubling_allreduce_
from gradientflow_repro.comm.ring import ring_allreduce_, ring_sum

from comm_workers import check_csc_selection_and_no_loss, check_ddp_csc_hook, check_ddp_ring_hook, check_lazy_pool
from conftest import save_failures, spawn, spawn_checked
from nccl_order import StreamHang, nccl_order

SIZES = [1, 7, 4099, 65_537]


def _algorithms(rank: int, world: int, out: str) -> None:
    per_node = 2 if world % 2 == 0 else 1
    hierarchical = HierarchicalSum(per_node, segment_bytes=4096)
    failures = []
    for size in SIZES:
        for dtype in (torch.float32, torch.float16):
            generator = torch.Generator().manual_seed(1000 * rank + size)
            local = torch.randn(size, generator=generator).to(dtype)
            reference = local.clone()
            dist.all_reduce(reference)
            for name, run in (("ring", lambda t: ring_allreduce_(t, segment_bytes=4096)),
                              ("hierarchical", lambda t: hierarchical(t, CommStats())),
                              ("fp16 wire", lambda t: Fp16Wire(ring_sum(segment_bytes=4096), world)(t, CommStats()))):
                mine = local.clone()
                run(mine)
                tolerance = 1e-5 if dtype == torch.float32 and name != "fp16 wire" else 5e-3 * world
                if not torch.allclose(mine.float(), reference.float(), rtol=tolerance, atol=tolerance):
                    failures.append(f"{name} size {size} {dtype}: max error "
                                    f"{(mine.float() - reference.float()).abs().max():.3g}")
    save_failures(failures, out, rank)


WORKERS = {"ring, hierarchical, fp16 wire": _algorithms, "lazy pool": check_lazy_pool,
           "csc": check_csc_selection_and_no_loss, "ddp sum_hook (ring)": check_ddp_ring_hook,
           "ddp csc_hook (ring)": check_ddp_csc_hook}


def _every_strategy_under_nccl_order(rank: int, world: int, out: str) -> None:
    for index, (name, worker) in enumerate(WORKERS.items()):
        folder = Path(out) / str(index)
        folder.mkdir(exist_ok=True)
        with nccl_order(timeout_s=20):
            if worker is check_lazy_pool:
                worker(rank, world, str(folder), True)  # overlap: the communication thread issues
            else:
                worker(rank, world, str(folder))
        dist.barrier()


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_point_to_point_strategy_completes_under_nccl_ordering(world: int, tmp_path: Path) -> None:
    spawn(_every_strategy_under_nccl_order, world, str(tmp_path))
    for index, name in enumerate(WORKERS):
        folder = tmp_path / str(index)
        for rank in range(world):
            outcome = torch.load(folder / f"rank{rank}.pt")
            assert outcome in ([], True), f"{name}, rank {rank}: {outcome}"


def _recursive_doubling(rank: int, world: int, out: str) -> None:
    """Recursive doubling's sum under the double (world 3: one folded pair), odd lengths, against
    ``dist.all_reduce``; every rank with the same bits."""
    failures = []
    with nccl_order(timeout_s=20):
        for size in (7, 1001):
            for dtype in (torch.float32, torch.float16):
                local = (torch.randn(size, generator=torch.Generator().manual_seed(1000 * rank + size))).to(dtype)
                reference = local.clone()
                dist.all_reduce(reference)
                mine = local.clone()
                recursive_doubling_allreduce_(mine)
                tolerance = 1e-5 if dtype == torch.float32 else 5e-3 * world
                if not torch.allclose(mine.float(), reference.float(), rtol=tolerance, atol=tolerance):
                    error = (mine.float() - reference.float()).abs().max()
                    failures.append(f"size {size} {dtype}: max error {error:.3g}")
                first = mine.clone()
                dist.broadcast(first, src=0)
                if not torch.equal(first, mine):
                    failures.append(f"size {size} {dtype}: differs from rank 0")
    save_failures(failures, out, rank)


@pytest.mark.parametrize("world", [3, 4])
def test_recursive_doubling_completes_under_nccl_ordering(world: int, tmp_path: Path) -> None:
    spawn_checked(_recursive_doubling, world, tmp_path)


def _receive_before_send(rank: int, world: int, out: str) -> None:
    """What the ring did before: the next receive queued ahead of the send it depends on."""
    left, right = (rank - 1) % world, (rank + 1) % world
    # a group of its own: gloo may drop a link whose op timed out, and the default group's links
    # must stay whole for the closing barrier
    group = dist.new_group()
    with pytest.raises(StreamHang) as hang:
        with nccl_order(timeout_s=2):
            inbox = torch.zeros(1000)
            receive = dist.irecv(inbox, src=left, group=group, tag=1)
            dist.isend(torch.ones(1000), dst=right, group=group, tag=1)
            receive.wait()
    caught = str(hang.value)
    torch.save(caught, Path(out) / f"rank{rank}.pt")


@pytest.mark.parametrize("world", [2, 3])
def test_the_double_catches_a_receive_queued_before_its_send(world: int, tmp_path: Path) -> None:
    spawn(_receive_before_send, world, str(tmp_path))
    for rank in range(world):
        message = torch.load(tmp_path / f"rank{rank}.pt")
        assert "recv from rank" in message and "did not complete" in message or "never met" in message, message

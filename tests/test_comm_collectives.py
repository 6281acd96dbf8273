"""Ring, hierarchical, fp16 wire and the lazy pool against torch.distributed.all_reduce, in real
gloo processes (world sizes 2, 3, 4), on odd sizes and on fp32, bf16 and fp16."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from gradientflow_repro.comm.base import CommStats, builtin_sum
from gradientflow_repro.comm.compression import Fp16Wire, compress, peak_magnitude
from gradientflow_repro.comm.hierarchical import HierarchicalSum
from gradientflow_repro.comm.lazy import LazyAllreduce
from gradientflow_repro.comm.ring import ring_allreduce_, ring_sum

from comm_workers import SIZES, check_ddp_ring_hook, check_lazy_pool, local_tensor
from conftest import save_failures, spawn, spawn_checked

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOLERANCE = {torch.float32: (1e-5, 1e-6), torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)}


def _algorithms(rank: int, world: int, out: str) -> None:
    per_node = 2  # world 4: two emulated nodes of two ranks; world 3: nodes of two and one
    hierarchical = HierarchicalSum(per_node, segment_bytes=4096)
    failures = []
    for size in SIZES:
        for dtype in DTYPES:
            reference = local_tensor(size, dtype, rank)
            dist.all_reduce(reference)
            for name, run in (("ring", lambda t: ring_allreduce_(t, segment_bytes=4096)),
                              ("hierarchical", lambda t: hierarchical(t, CommStats()))):
                mine = local_tensor(size, dtype, rank)
                run(mine)
                rtol, atol = TOLERANCE[dtype]
                if not torch.allclose(mine.float(), reference.float(), rtol=rtol, atol=atol * world):
                    failures.append(f"{name} size {size} {dtype}: max error "
                                    f"{(mine.float() - reference.float()).abs().max():.3g}")
    # a ring allreduce sends exactly 2(N-1)/N of the tensor
    sent = ring_allreduce_(torch.ones(4099 * world))
    if sent != 2 * (world - 1) * 4099 * 4:
        failures.append(f"ring sent {sent} bytes")
    # a two-rank ring (an exchange with one peer) cuts its segments to EXCHANGE_SEGMENT_BYTES: a 2 MiB
    # tensor's 1 MiB chunks go in 2 segments per step there, in 1 with more ranks (4 MiB segments)
    groups, issue = [0], dist.batch_isend_irecv

    def counting(ops: list) -> list:
        groups[0] += 1
        return issue(ops)
    dist.batch_isend_irecv = counting
    try:
        ring_allreduce_(torch.ones((2 << 20) // 4))
    finally:
        dist.batch_isend_irecv = issue
    if groups[0] != 2 * (world - 1) * (2 if world == 2 else 1):
        failures.append(f"a 2 MiB ring allreduce issued {groups[0]} send/receive groups at world size {world}")
    # fp16 and bf16 segments are added in fp32 and rounded once: at two ranks (one addition) the
    # ring's result is bitwise that of the reference expression
    if world == 2:
        for dtype in (torch.float16, torch.bfloat16):
            mine = local_tensor(4099, dtype, rank, salt=3) * 7
            both = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(both, mine)
            ring_allreduce_(mine, segment_bytes=1024)
            if not torch.equal(mine, (both[0].float() + both[1].float()).to(dtype)):
                failures.append(f"ring {dtype}: not the fp32 sum rounded once")
    # fp16 wire around the ring stays within half precision of the fp32 sum
    stats = CommStats()
    reference = local_tensor(4099, torch.float32, rank, salt=1)
    dist.all_reduce(reference)
    mine = local_tensor(4099, torch.float32, rank, salt=1)
    # half precision: every rounding (one per hop) errs by at most 2^-11 of |partial sum| <= N * max
    bound = world * world * 2.0 ** -11 * mine.abs().max().item()
    Fp16Wire(ring_sum(), world)(mine, stats)
    if not torch.allclose(mine, reference, rtol=0, atol=bound) or mine.dtype != torch.float32:
        failures.append(f"fp16 wire: max error {(mine - reference).abs().max():.3g}")
    if stats.bytes > 2 * (world - 1) * 4099 * 2 // world * 1.01 + 64:
        failures.append(f"fp16 wire sent {stats.bytes} bytes: not half of fp32")
    # gradients far below fp16's smallest number survive thanks to the agreed power-of-two scale
    tiny = local_tensor(4099, torch.float32, rank, salt=2) * 1e-9
    tiny_reference = tiny.clone()
    dist.all_reduce(tiny_reference)
    bound = world * world * 2.0 ** -11 * tiny.abs().max().item()
    Fp16Wire(builtin_sum(), world)(tiny, CommStats())
    if not torch.allclose(tiny, tiny_reference, rtol=0, atol=bound) or not tiny.abs().sum() > 0:
        failures.append("fp16 wire flushed tiny gradients")
    # an inf on one rank reaches every rank (so the step is skipped everywhere), never clamped
    poisoned = torch.ones(10)
    if rank == 0:
        poisoned[3] = float("inf")
    Fp16Wire(ring_sum(), world)(poisoned, CommStats())
    if torch.isfinite(poisoned).all():
        failures.append("fp16 wire hid an inf")
    save_failures(failures, out, rank)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_hierarchical_fp16_wire_match_builtin_allreduce(world: int, tmp_path: Path) -> None:
    spawn_checked(_algorithms, world, tmp_path)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("overlap", [True, False])
def test_lazy_pool_matches_allreduce_average(world: int, overlap: bool, tmp_path: Path) -> None:
    spawn_checked(check_lazy_pool, world, tmp_path, overlap)


def _accumulation(rank: int, world: int, out: str) -> None:
    model = nn.Linear(3, 2)
    pool = LazyAllreduce(torch.device("cpu"), builtin_sum(), bucket_bytes=1 << 20, overlap=True)
    pool.attach(model)
    batches = [torch.randn(4, 3, generator=torch.Generator().manual_seed(rank * 7 + i)) for i in range(3)]
    with pool.accumulating():
        for batch in batches[:2]:
            model(batch).sum().backward()
    model(batches[2]).sum().backward()
    pool.synchronize()
    reference = nn.Linear(3, 2)
    reference.load_state_dict(model.state_dict())
    reference(torch.cat(batches)).sum().backward()
    expected = reference.weight.grad.clone()
    dist.all_reduce(expected)
    ok = torch.allclose(model.weight.grad, expected / world, rtol=1e-5, atol=1e-6)
    pool.close()
    torch.save(ok, Path(out) / f"rank{rank}.pt")


def test_lazy_pool_gradient_accumulation(tmp_path: Path) -> None:
    spawn(_accumulation, 2, str(tmp_path))
    assert all(torch.load(tmp_path / f"rank{r}.pt") for r in range(2))


def test_ring_as_a_ddp_communication_hook(tmp_path: Path) -> None:
    spawn(check_ddp_ring_hook, 3, str(tmp_path))
    assert all(torch.load(tmp_path / f"rank{r}.pt") for r in range(3))


def test_the_fp16_wire_finds_the_peak_in_one_pass_and_reuses_its_buffer() -> None:
    assert peak_magnitude(torch.tensor([1.0, -3.0, 2.0])).tolist() == [3.0]
    assert peak_magnitude(torch.tensor([1.0, float("nan")])).isnan().all()
    assert peak_magnitude(torch.tensor([1.0, float("-inf")])).tolist() == [float("inf")]
    scale = torch.tensor([4.0])
    first, second = torch.randn(1000), torch.randn(1000)
    original = second.clone()
    a, b = compress(first, scale), compress(second, scale)
    # scaled in fp32 and rounded once, into the wire buffer; the gradient itself is left alone
    assert torch.equal(b, (original * 4).half()) and torch.equal(second, original)
    # no fresh buffer per message (page faults on a CPU): the same storage, this thread's
    assert a.data_ptr() == b.data_ptr()
    with ThreadPoolExecutor(1) as pool:  # another thread (a communication thread) has its own
        assert pool.submit(lambda: compress(torch.randn(1000), scale).data_ptr()).result() != b.data_ptr()

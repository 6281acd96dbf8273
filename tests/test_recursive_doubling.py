"""Recursive doubling against ``dist.all_reduce``, in real gloo processes: world sizes 2, 3, 5 and 8
(powers of two and the MPICH fold with one, two and three folded pairs through a subgroup of all but
rank 0), odd lengths, sum and max, fp32, fp16 and bf16; every rank bitwise equal to the others; the
bytes it reports; ``small_sum`` and ``SizedSum``; the fp16 wire's self-scaled small messages; and
the small-message benchmark on tiny sizes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from gradientflow_repro.comm import recursive_doubling
from gradientflow_repro.comm.base import CommStats, ring_bytes
from gradientflow_repro.comm.compression import (
    FP16_SAFE_MAX,
    Fp16Wire,
    decode_self_scaled,
    encode_self_scaled,
    exponent_for,
    self_scaled_combine,
    self_scaled_sum_,
)
from gradientflow_repro.comm.recursive_doubling import SizedSum, recursive_doubling_allreduce_, small_sum
from gradientflow_repro.comm.ring import ring_allreduce_, ring_sum

from conftest import save_failures, spawn_checked

SIZES = [1, 7, 1001]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}
BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def expected_sent(rank: int, world: int, nbytes: int) -> int:
    """log2(p) whole messages for the ranks that double; a folded (even) rank sends once, its odd
    partner once more than the others (the result back)."""
    p = 1 << (world.bit_length() - 1)
    rem, steps = world - p, p.bit_length() - 1
    if rank < 2 * rem:
        return nbytes if rank % 2 == 0 else (steps + 1) * nbytes
    return steps * nbytes


def _local(size: int, dtype: torch.dtype, rank: int, salt: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * rank + size + salt)
    return (torch.randn(size, generator=generator) * 3).to(dtype)


def _check(group: dist.ProcessGroup | None, label: str) -> list[str]:
    """Every size, op and dtype over ``group`` against ``dist.all_reduce``: the failures."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    failures = []
    for size in SIZES:
        for op in ("sum", "max"):
            for dtype in DTYPES:
                case = f"{label} size {size} {op} {dtype}"
                local = _local(size, dtype, dist.get_rank())
                reference = local.clone()
                dist.all_reduce(reference, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=group)
                mine = local.clone()
                sent = recursive_doubling_allreduce_(mine, group, op)
                if sent != expected_sent(rank, world, size * local.element_size()):
                    failures.append(f"{case}: sent {sent} bytes")
                if mine.dtype != dtype:
                    failures.append(f"{case}: came back as {mine.dtype}")
                if op == "max":
                    if not torch.equal(mine, reference):
                        failures.append(f"{case}: differs from all_reduce MAX")
                else:
                    # each rounding, ours (at most log2(N) + 1 on a path) or the reference's (at most
                    # N - 1), errs by at most the unit roundoff times a partial sum <= sum_i |x_i|
                    magnitude = local.float().abs()
                    dist.all_reduce(magnitude, group=group)
                    bound = (world.bit_length() + world) * UNIT_ROUNDOFF[dtype] * magnitude
                    error = (mine.float() - reference.float()).abs()
                    if not (error <= bound).all():
                        failures.append(f"{case}: max error {error.max():.3g} (bound {bound.max():.3g})")
                # every rank ends with the same bits (widened to int32: gloo has no int16)
                bits = mine.view(BITS[dtype]).to(torch.int32)
                gathered = [torch.empty_like(bits) for _ in range(world)]
                dist.all_gather(gathered, bits, group=group)
                if not all(torch.equal(g, gathered[0]) for g in gathered):
                    failures.append(f"{case}: ranks differ bitwise")
    return failures


def _check_self_scaled(group: dist.ProcessGroup | None, label: str) -> list[str]:
    """The fp16 wire's self-scaled recursive doubling over ``group`` against ``dist.all_reduce`` of
    fp32: far below and far above fp16's range (each message scaled by its own peak), every rank the
    same bits, the bytes it reports, and an inf or a NaN on one rank reaching every rank."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    failures = []
    for size in SIZES:
        for magnitude in (1e-9, 1.0, 1e9):
            case = f"{label} self-scaled size {size} x{magnitude:g}"
            # ranks differ by orders of magnitude, so partners' messages carry different exponents
            local = _local(size, torch.float32, dist.get_rank(), salt=7) * magnitude * 10.0 ** (3 * dist.get_rank())
            reference, total = local.clone(), local.abs()
            dist.all_reduce(reference, group=group)
            dist.all_reduce(total, group=group)
            mine = local.clone()
            sent = self_scaled_sum_(mine, group)
            if sent != expected_sent(rank, world, 2 * (size + 1)):  # fp16, and the scale's exponent
                failures.append(f"{case}: sent {sent} bytes")
            # one fp16 rounding per step and the last decoding, each at most 2^-11 of a partial sum
            # <= sum_i |x_i| (a message's smallest entries are subnormal: 2^-40 of its peak)
            rounds = world.bit_length() + 2
            bound = rounds * 2.0 ** -11 * total + rounds * 2.0 ** -40 * total.max()
            error = (mine - reference).abs()
            if mine.dtype != torch.float32 or not (error <= bound).all():
                failures.append(f"{case}: max error {error.max():.3g} (bound {bound.max():.3g})")
            if magnitude != 1.0 and not (mine.abs() > 0).any():
                failures.append(f"{case}: flushed to zero")
            bits = mine.view(torch.int32)
            gathered = [torch.empty_like(bits) for _ in range(world)]
            dist.all_gather(gathered, bits, group=group)
            if not all(torch.equal(g, gathered[0]) for g in gathered):
                failures.append(f"{case}: ranks differ bitwise")
    for poison in (float("inf"), float("nan")):
        tensor = torch.ones(9)
        if rank == world - 1:
            tensor[4] = poison
        self_scaled_sum_(tensor, group)
        if torch.isfinite(tensor[4]) or not torch.isfinite(torch.cat([tensor[:4], tensor[5:]])).all():
            failures.append(f"{label} self-scaled: a {poison} on one rank came back as {tensor.tolist()}")
    return failures


def test_self_scaled_messages_encode_exactly_at_the_edges() -> None:
    """One process: the exponent is the largest that keeps the peak at most 2^15 (never above
    126, so undoing it needs no subnormal fp32); decoding undoes it exactly; zero, -0, inf and NaN
    travel as they are; two messages combine to the same bits whichever one is overwritten."""
    fp32_max, fp32_tiny = torch.finfo(torch.float32).max, 2.0 ** -149
    for peak, k in ((2.0 ** 15, 0), (2.0 ** 15 + 1, -1), (1.0, 15), (0.75, 15), (0.5, 16), (fp32_max, -113),
                    (fp32_tiny, 126), (0.0, 0), (float("inf"), 0), (float("nan"), 0)):
        assert exponent_for(peak) == k, (peak, exponent_for(peak), k)
    for peak in (3.0, 1e-30, 7e4, 1e38, 2.0 ** -100):
        assert peak * 2.0 ** exponent_for(peak) <= FP16_SAFE_MAX < peak * 2.0 ** (exponent_for(peak) + 1)
    values = torch.tensor([0.0, -0.0, 1.5, -3e-5, 6e4, 2.0 ** -140])
    message = torch.empty(values.numel() + 1, dtype=torch.float16)
    encode_self_scaled(values, message)
    decoded = torch.empty_like(values)
    decode_self_scaled(message, decoded)
    assert message[-1].item() == exponent_for(6e4)
    assert torch.equal(decoded, (values * 2.0 ** message[-1].item()).half().float() / 2.0 ** message[-1].item())
    assert torch.signbit(decoded[1]) and decoded[0] == 0
    for poison in (float("inf"), float("-inf"), float("nan")):
        encode_self_scaled(torch.tensor([1.0, poison]), message[:3])
        decode_self_scaled(message[:3], decoded[:2])
        assert decoded[0] == 1.0 and (torch.isnan(decoded[1]) if poison != poison else decoded[1] == poison)
    first, second = torch.empty(4, dtype=torch.float16), torch.empty(4, dtype=torch.float16)
    encode_self_scaled(torch.tensor([1.0, -2.0, 3e-3]), first)
    encode_self_scaled(torch.tensor([5e3, 7.0, -1e-4]), second)
    into_first, into_second = first.clone(), second.clone()
    self_scaled_combine(into_first, into_first, second)
    self_scaled_combine(into_second, first, into_second)
    assert torch.equal(into_first, into_second)
    summed = torch.empty(3)
    decode_self_scaled(into_first, summed)
    assert torch.allclose(summed, torch.tensor([5001.0, 5.0, 2.9e-3]), rtol=2.0 ** -10)


def _wire_routes(rank: int, world: int) -> list[str]:
    """The fp16 wire around a size-switching sum: a small message goes self-scaled in one
    collective; a large one agrees on a scale first (two); on NCCL even a small one agrees (NCCL's
    allreduce carries it and cannot rescale between steps)."""
    failures = []
    sized = Fp16Wire(SizedSum(ring_sum(), threshold_bytes=64), world)
    for size, collectives, sent in ((32, 1, expected_sent(rank, world, 66)),
                                    (33, 2, expected_sent(rank, world, 4) + ring_allreduce_(torch.ones(33).half()))):
        stats, tensor = CommStats(), torch.full((size,), float(rank))
        sized(tensor, stats)
        if (stats.collectives, stats.bytes) != (collectives, sent):
            failures.append(f"fp16 wire, {size} elements: {stats}, not {collectives} collective(s), {sent} bytes")
        if not torch.equal(tensor, torch.full((size,), float(sum(range(world))))):
            failures.append(f"fp16 wire, {size} elements: wrong sum")
    strided = torch.full((4, 6), float(rank)).t()  # a transposed view: summed by the agreed scale
    stats = CommStats()
    sized(strided, stats)
    if stats.collectives != 2 or not torch.equal(strided, torch.full((6, 4), float(sum(range(world))))):
        failures.append(f"fp16 wire, a strided view: {stats}, {strided.flatten().tolist()[:4]}")
    real_backend = dist.get_backend
    dist.get_backend = lambda group=None: "nccl"
    try:
        stats = CommStats()
        sized(torch.ones(8), stats)
    finally:
        dist.get_backend = real_backend
    if stats.collectives != 2:
        failures.append(f"fp16 wire on NCCL: {stats.collectives} collective(s), not the agreed scale and the sum")
    return failures


def _cases(rank: int, world: int, out: str) -> None:
    failures = _check(None, f"world {world}") + _check_self_scaled(None, f"world {world}")
    failures += _wire_routes(rank, world)
    # a subgroup of all but rank 0 (sizes 1, 2, 4, 7): group ranks are not global ranks
    subgroup = dist.new_group(list(range(1, world)))
    if rank > 0:
        failures += _check(subgroup, f"ranks 1..{world - 1}") + _check_self_scaled(subgroup, f"ranks 1..{world - 1}")
    # a group of one rank: nothing to do, nothing sent
    solo = dist.new_group([0])
    if rank == 0:
        alone = torch.arange(5.0)
        if recursive_doubling_allreduce_(alone, solo) != 0 or not torch.equal(alone, torch.arange(5.0)):
            failures.append("a group of one changed the tensor or sent bytes")
        stats = CommStats()
        small_sum(solo)(alone, stats)
        if stats.bytes or stats.collectives:
            failures.append(f"small_sum on a group of one counted {stats}")
    # an empty tensor sends nothing; a strided view and an unknown op are refused
    if recursive_doubling_allreduce_(torch.empty(0)) != 0:
        failures.append("an empty tensor sent bytes")
    for bad, kwargs, what in ((torch.ones(4, 4).t(), {}, "non-contiguous"), (torch.ones(4), {"op": "min"}, "op")):
        try:
            recursive_doubling_allreduce_(bad, **kwargs)
            failures.append(f"a {what} call was accepted")
        except ValueError:
            pass
    # small_sum on gloo: recursive doubling, its own bytes, one collective per call
    stats, tensor = CommStats(), torch.full((1001,), float(rank))
    small_sum()(tensor, stats)
    small_sum(op="max")(tensor, stats)
    if not torch.equal(tensor, torch.full((1001,), float(sum(range(world))))):
        failures.append("small_sum: wrong sum or max")
    if (stats.bytes, stats.collectives) != (2 * expected_sent(rank, world, 4004), 2):
        failures.append(f"small_sum counted {stats}")
    # on an NCCL group it calls the backend's allreduce with the right op and counts ring bytes
    real_backend = dist.get_backend
    dist.get_backend = lambda group=None: "nccl"
    try:
        stats, tensor = CommStats(), torch.full((7,), float(rank))
        small_sum(op="max")(tensor, stats)
    finally:
        dist.get_backend = real_backend
    if not torch.equal(tensor, torch.full((7,), float(world - 1))) or \
            (stats.bytes, stats.collectives) != (ring_bytes(28, world), 1):
        failures.append(f"small_sum on NCCL: {tensor.tolist()}, {stats}")
    # SizedSum: up to the threshold by recursive doubling, above it by the large function
    stats = CommStats()
    at, above = torch.full((16,), 1.0), torch.full((17,), 1.0)
    sized = SizedSum(ring_sum(), threshold_bytes=64)
    sized(at, stats)
    if stats.bytes != expected_sent(rank, world, 64):
        failures.append(f"SizedSum: 64 bytes sent {stats.bytes}, not by recursive doubling")
    sized(above, stats)
    by_ring = ring_allreduce_(torch.ones(17))  # the ring's bytes for 17 elements on this rank
    if stats.bytes - expected_sent(rank, world, 64) != by_ring or stats.collectives != 2:
        failures.append(f"SizedSum: 68 bytes counted {stats}, not by the ring")
    if not (torch.equal(at, torch.full((16,), float(world))) and torch.equal(above, torch.full((17,), float(world)))):
        failures.append("SizedSum: wrong sums")
    save_failures(failures, out, rank)


@pytest.mark.parametrize("world", [2, 3, 5, 8])
def test_recursive_doubling_matches_all_reduce(world: int, tmp_path: Path) -> None:
    spawn_checked(_cases, world, tmp_path, timeout_s=30)


def test_default_threshold_is_a_measured_power_of_four() -> None:
    """The bench measures powers of four from 4 B: the constant must be one of them."""
    size = recursive_doubling.SMALL_MESSAGE_BYTES
    assert size >= 4 and size & (size - 1) == 0 and (size.bit_length() - 1) % 2 == 0


def test_small_message_bench_writes_the_table(tmp_path: Path) -> None:
    from gradientflow_repro.bench.small_allreduce import bench_small

    out = tmp_path / "small.md"
    text = bench_small(out, worlds=(2,), max_bytes=64, budget_s=0.01, min_calls=3, command="bench test")
    assert out.read_text() == text
    for label in ("| 4 B |", "| 16 B |", "| 64 B |", "Command: `bench test`", "## World size 2",
                  "Switch-over"):
        assert label in text, label

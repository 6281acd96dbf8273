"""CSC's re-decided choices: staleness-aware momentum masking (``comm.masking_min_wait``), the
ranking under LARS (``comm.rank_by``), the chunks' ages and the send statistics every sparse run logs.
The ranking and the statistics in real gloo processes, against ``torch.distributed.all_reduce``."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from gradientflow_repro.comm.base import CommStats
from gradientflow_repro.comm.csc import BucketState, CSCCommunicator, chunk_l1_norms, lars_rescale_, select_chunks
from gradientflow_repro.comm.csc.state import SendLog
from gradientflow_repro.comm.ring import ring_sum
from gradientflow_repro.optim import Lars, parameter_groups

from comm_workers import CPU, TwoLayerNet
from conftest import save_failures, spawn_checked

NOTHING = lambda tensor, stats: None  # noqa: E731 (one rank: the sums are the tensors themselves)


def _state_with_velocity(ages: list[float]) -> tuple[BucketState, torch.Tensor]:
    """A bucket of 4 chunks of 5 whose chunks 1 and 2 have the largest norms, with the given ages
    and a velocity staged (u = the gradient)."""
    state = BucketState.zeros(4, 5, CPU, velocity_elements=20)
    state.age.copy_(torch.tensor(ages))
    gradient = torch.tensor([1.0, 4.0, 3.0, 0.5]).repeat_interleave(5).view(4, 5)
    moved = state.add_momentum(gradient.view(-1), 0.9)
    return state, moved.view(4, 5)


@pytest.mark.parametrize("mask_after, masked", [(None, []), (0.0, [1, 2]), (10.0, [1]), (20.0, [])])
def test_masking_clears_the_velocity_of_chunks_that_waited_longer(mask_after, masked) -> None:
    """Chunk 1 waited 13 steps, chunk 2 four: DGC's rule (0) masks both, a threshold of 10 only the
    one that waited longer, no masking neither; ages restart at 0 for the sent chunks and grow by
    one for the others; the send log has each sent chunk's wait and the share of momentum erased."""
    state, moved = _state_with_velocity([0.0, 12.0, 3.0, 7.0])
    before = moved.clone()
    sent = state.sparsify(moved, 0.5, NOTHING, NOTHING, CommStats(), mask_after=mask_after)
    assert sent.chosen.tolist() == [1, 2]
    state.commit()
    cleared = [row for row in range(4) if not state.velocity.view(4, 5)[row].any()]
    assert cleared == masked
    assert state.age.tolist() == [1.0, 0.0, 0.0, 8.0]
    chosen, waited, velocity_l1, masked_l1 = state.sends.take()
    assert chosen.tolist() == [1, 2] and waited.tolist() == [13.0, 4.0]
    assert velocity_l1.item() == pytest.approx(before.abs().sum().item())
    assert masked_l1.item() == pytest.approx(before[masked].abs().sum().item() if masked else 0.0)
    assert state.sends.take() == (None, None, None, None)  # taken: the log starts afresh


def test_ages_are_checkpointed_and_an_older_state_starts_them_at_zero() -> None:
    state, moved = _state_with_velocity([0.0, 12.0, 3.0, 7.0])
    state.sparsify(moved, 0.5, NOTHING, NOTHING, CommStats(), mask_after=0.0)
    state.commit()
    saved = state.state_dict()
    assert saved["age"].tolist() == [1.0, 0.0, 0.0, 8.0]
    fresh = BucketState.zeros(4, 5, CPU, velocity_elements=20)
    fresh.load_state_dict(saved)
    assert torch.equal(fresh.age, state.age)
    older = BucketState.zeros(4, 5, CPU, velocity_elements=20)
    older.load_state_dict({key: value for key, value in saved.items() if key != "age"})
    assert older.age.tolist() == [0.0] * 4


def test_send_log_keeps_the_newest_when_nobody_takes_it() -> None:
    log = SendLog()
    for step in range(10_050):
        log.record(torch.tensor([step]), torch.tensor([1.0]), None, None)
    chosen = log.take()[0]
    assert chosen.numel() < 10_050 and chosen[-1].item() == 10_049


def test_lars_rescale_returns_the_ratio_it_applied() -> None:
    gradient, weight = torch.full((4,), 3.0), torch.full((4,), 2.0)  # |g| = 6, |w| = 4
    group = {"weight_decay": 0.5, "trust_coeff": 0.1, "eps": 0.0}
    (ratio,) = lars_rescale_([gradient], [weight], [group])
    assert ratio.item() == pytest.approx(0.1 * 4 / (6 + 4 * 0.5))
    assert torch.allclose(gradient, (torch.full((4,), 3.0) + 0.5 * weight) * ratio)


def test_masking_threshold_and_ranking_are_checked() -> None:
    with pytest.raises(ValueError, match="comm.masking_min_wait"):
        CSCCommunicator(CPU, NOTHING, 4096, overlap=False, chunk_size=100, density=0.1, warmup_epochs=1.0,
                        masking_min_wait=-1.0)
    with pytest.raises(ValueError, match="comm.rank_by"):
        CSCCommunicator(CPU, NOTHING, 4096, overlap=False, chunk_size=100, density=0.1, warmup_epochs=1.0,
                        rank_by="velocity")


def _owner_of_chunks(bucket, chunk_size: int) -> list[int]:
    """For each chunk of the part, the position in ``bucket.params`` of the parameter that holds its
    first element (written out, not with searchsorted)."""
    owners = []
    for chunk in range(bucket.sparse_elements // chunk_size):
        first = chunk * chunk_size
        owners.append(max(i for i, offset in enumerate(bucket.offsets) if offset <= first))
    return owners


def _ranking_and_stats(rank: int, world: int, out: str, rank_by: str) -> None:
    """Every rank its own batches, Lars, CSC sparse from the first step with momentum correction and
    staleness-aware masking. Each step, for every part: the chosen chunks are the top of the
    chunk norms (times 1 / the layer's trust ratio under ``raw``) summed by ``dist.all_reduce``, the
    same on every rank, and the ages agree; the logged statistics match the sends observed."""
    failures, chunk_size, density = [], 100, 0.3
    model = TwoLayerNet()
    optimizer = Lars(parameter_groups(model, 5e-4), lr=0.5, momentum=0.9, trust_coeff=0.06)
    comm = CSCCommunicator(CPU, ring_sum(segment_bytes=1024), bucket_bytes=1 << 20, overlap=False,
                           chunk_size=chunk_size, density=density, warmup_epochs=0.0,
                           momentum_correction=True, masking_min_wait=2.0, rank_by=rank_by,
                           trust_noise_correction=False)
    comm.attach(model, optimizer)
    seen: list[tuple] = []  # (part, local norms x weights, the weights, chosen)
    original = BucketState.sparsify

    def spy(self, gradient, density, *args, **kwargs):
        norms = chunk_l1_norms(self.residual + gradient)
        weights = kwargs.get("rank_weights")
        sent = original(self, gradient, density, *args, **kwargs)
        seen.append((self, norms if weights is None else norms * weights, weights, sent.chosen.clone()))
        return sent

    BucketState.sparsify = spy
    sent_waits: dict[str, list[float]] = {}
    try:
        for step in range(6):
            comm.begin_step(epoch=1.0 + step)
            batch = torch.Generator().manual_seed(100 * rank + step)
            x, target = torch.randn(8, 37, generator=batch), torch.randn(8, 11, generator=batch)
            ages_before = {id(part): part.age.clone() for part in comm.parts if part.residual is not None}
            (model(x) - target).pow(2).mean().backward()
            comm.synchronize()
            optimizer.step()
            comm.end_step(True)
            optimizer.zero_grad(set_to_none=True)
            for part, local, weights, chosen in seen:
                bucket = comm.buckets[comm.parts.index(part)]
                if rank_by == "raw":
                    ratios = comm.local_step.ratios[bucket.index]
                    expected = torch.stack([1.0 / ratios[i] for i in _owner_of_chunks(bucket, chunk_size)])
                    if weights is None or not torch.allclose(weights, expected):
                        failures.append(f"step {step}: rank weights {weights} are not 1 / the owners' ratios")
                elif weights is not None:
                    failures.append(f"step {step}: rescaled ranking got weights")
                summed = local.clone()
                dist.all_reduce(summed)
                reference = select_chunks(summed, density)
                if not torch.equal(chosen, reference):
                    failures.append(f"step {step}: chose {chosen.tolist()}, all_reduce's top is {reference.tolist()}")
                everyone = [torch.empty_like(chosen) for _ in range(world)]
                dist.all_gather(everyone, chosen)
                if any(not torch.equal(c, chosen) for c in everyone):
                    failures.append(f"step {step}: ranks chose different chunks")
                ages = [torch.empty_like(part.age) for _ in range(world)]
                dist.all_gather(ages, part.age)
                if any(not torch.equal(a, part.age) for a in ages):
                    failures.append(f"step {step}: the ranks' chunk ages differ")
                owners = _owner_of_chunks(bucket, chunk_size)
                for chunk in chosen.tolist():
                    name = comm._layer_names[bucket.index][owners[chunk]]
                    sent_waits.setdefault(name, []).append(ages_before[id(part)][chunk].item() + 1)
            seen.clear()
        stats = comm.sparsity_stats()
        expected = {name: float(torch.tensor(waits).median()) for name, waits in sent_waits.items()}
        if stats.get("csc_send_interval_median") != expected:
            failures.append(f"logged intervals {stats.get('csc_send_interval_median')}, observed {expected}")
        if stats.get("csc_chunks_sent") != sum(len(w) for w in sent_waits.values()):
            failures.append(f"logged {stats.get('csc_chunks_sent')} sends")
        share = stats.get("csc_masked_momentum_share", math.nan)
        if not 0.0 < share < 1.0:  # some chunks waited more than 2 steps, not all
            failures.append(f"masked momentum share {share}")
        if comm.sparsity_stats() != {}:
            failures.append("the statistics were not taken")
    finally:
        BucketState.sparsify = original
        comm.close()
    save_failures(failures, out, rank)


@pytest.mark.parametrize("world, rank_by", [(2, "raw"), (3, "raw"), (3, "rescaled")])
def test_ranking_and_send_statistics_against_all_reduce(world: int, rank_by: str, tmp_path: Path) -> None:
    spawn_checked(_ranking_and_stats, world, tmp_path, rank_by)


def _local_decay_keeps_the_ranks_together(rank: int, world: int, out: str, optimizer_kind: str) -> None:
    """Different batches on every rank, CSC sparse from the first step with weight decay in a local
    velocity: under SGD the ranks' weights stay equal (``dist.all_gather``) and differ from a run
    with the decay in the sent velocity; under LARS (each rank's own trust ratio) it is refused."""
    failures = []
    weights = {}
    for decay_in in ("local", "velocity"):
        model = TwoLayerNet()
        if optimizer_kind == "sgd":
            optimizer = torch.optim.SGD(parameter_groups(model, 0.05), lr=0.05, momentum=0.9)
        else:
            optimizer = Lars(parameter_groups(model, 5e-4), lr=0.5, momentum=0.9, trust_coeff=0.06)
        comm = CSCCommunicator(CPU, ring_sum(segment_bytes=1024), bucket_bytes=1 << 20, overlap=False,
                               chunk_size=100, density=0.3, warmup_epochs=0.0, weight_decay_in=decay_in)
        try:
            comm.attach(model, optimizer)
        except ValueError as error:
            if optimizer_kind == "lars" and decay_in == "local" and "comm.weight_decay_in" in str(error):
                comm.close()
                continue  # refused, as it must be
            raise
        if optimizer_kind == "lars" and decay_in == "local":
            failures.append("local weight decay under LARS on several ranks was not refused")
        for step in range(5):
            comm.begin_step(epoch=1.0 + step)
            batch = torch.Generator().manual_seed(100 * rank + step)
            x, target = torch.randn(8, 37, generator=batch), torch.randn(8, 11, generator=batch)
            (model(x) - target).pow(2).mean().backward()
            comm.synchronize()
            optimizer.step()
            comm.end_step(True)
            optimizer.zero_grad(set_to_none=True)
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        everyone = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(everyone, flat)
        if any(not torch.equal(other, flat) for other in everyone):
            failures.append(f"{decay_in}: the ranks' weights differ")
        weights[decay_in] = flat
        comm.close()
    if optimizer_kind == "sgd" and torch.equal(weights["local"], weights["velocity"]):
        failures.append("local and sent weight decay trained the same weights: the option did nothing")
    save_failures(failures, out, rank)


@pytest.mark.parametrize("world, optimizer_kind", [(3, "sgd"), (2, "lars")])
def test_local_weight_decay_keeps_the_ranks_weights_equal_or_is_refused(world: int, optimizer_kind: str,
                                                                       tmp_path: Path) -> None:
    spawn_checked(_local_decay_keeps_the_ranks_together, world, tmp_path, optimizer_kind)

"""Coarse-grained sparse communication in real gloo processes: same choice on every rank, density 1
equals dense, nothing lost (sent + residuals = all gradients), exact restore from a checkpoint,
a skipped step leaves the state untouched."""

from __future__ import annotations

import io
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from gradientflow_repro.comm.base import CommStats, builtin_sum
from gradientflow_repro.comm.csc import (
    BucketState,
    CSCCommunicator,
    adapts,
    chunk_l1_norms,
    lars_rescale_,
    select_chunks,
)
from gradientflow_repro.comm.lazy import LazyAllreduce
from gradientflow_repro.comm.ring import ring_sum
from gradientflow_repro.optim import Lars, parameter_groups
from gradientflow_repro.scaling import perfmodel as pm

from comm_workers import (
    CPU,
    TwoLayerNet,
    backward,
    check_csc_selection_and_no_loss,
    check_ddp_csc_hook,
    csc,
)
from conftest import save_failures, spawn, spawn_checked


def test_chunk_norms_and_deterministic_selection() -> None:
    flat = torch.tensor([1.0, -1.0, 3.0, 0.5, -0.5, 2.0, 2.0, 0.0])
    assert chunk_l1_norms(flat.view(4, 2)).tolist() == [2.0, 3.5, 2.5, 2.0]
    assert select_chunks(torch.tensor([2.0, 3.5, 2.5, 2.0]), 0.5).tolist() == [1, 2]
    assert select_chunks(torch.tensor([1.0, 5.0, 1.0, 1.0]), 0.5).tolist() == [0, 1]  # tie: lower index
    assert select_chunks(torch.tensor([1.0, 2.0, 3.0]), 0.01).tolist() == [2]  # at least one chunk


def test_density_falls_exponentially_after_the_dense_warmup() -> None:
    ramped = CSCCommunicator(CPU, builtin_sum(), 4096, overlap=False, chunk_size=100, density=0.1,
                             warmup_epochs=1.0, density_ramp_epochs=3)
    epochs = (0.0, 0.99, 1.0, 1.99, 2.5, 3.0, 4.0, 9.0)
    expected = (1.0, 1.0, 0.1 ** 0.25, 0.1 ** 0.25, 0.1 ** 0.5, 0.1 ** 0.75, 0.1, 0.1)  # DGC: 0.56 0.32 0.18
    assert [ramped.density_at(e) for e in epochs] == pytest.approx(expected)
    at_once = CSCCommunicator(CPU, builtin_sum(), 4096, overlap=False, chunk_size=100, density=0.1,
                              warmup_epochs=1.0)
    assert [at_once.density_at(e) for e in (0.5, 1.0, 5.0)] == pytest.approx([1.0, 0.1, 0.1])
    with pytest.raises(ValueError, match="comm.density_ramp_epochs"):
        CSCCommunicator(CPU, builtin_sum(), 4096, overlap=False, chunk_size=100, density=0.1,
                        warmup_epochs=1.0, density_ramp_epochs=-1)


def test_dense_warmup_follows_the_learning_rate_warmup_unless_set() -> None:
    """The presets' ``comm.csc_warmup_epochs: null``: dense until the learning rate's warm-up ends
    (what the trainer passes), a number on its own; built outside training (no warm-up), sparse at once."""
    from gradientflow_repro.comm.factory import build_communicator

    for options, lr_warmup, dense_until in (({"strategy": "gradientflow"}, 2.0, 2.0),
                                            ({"strategy": "csc"}, 5.0, 5.0),
                                            ({"strategy": "gradientflow", "csc_warmup_epochs": 1}, 2.0, 1.0),
                                            ({"strategy": "gradientflow", "csc_warmup_epochs": 0}, 2.0, 0.0),
                                            ({"strategy": "gradientflow"}, 0.0, 0.0)):
        comm = build_communicator(options, CPU, lr_warmup_epochs=lr_warmup)
        before = [comm.density_at(e) for e in (0.0, dense_until - 0.01) if 0 <= e < dense_until]
        assert before == [1.0] * len(before) and comm.density_at(dense_until) == 0.1, (options, lr_warmup)
    assert build_communicator({"strategy": "gradientflow"}, CPU).density_at(0.0) == 0.1
    # the run's first lines say the resolved warm-up (its saved config says null) and where it came from
    assert (build_communicator({"strategy": "gradientflow"}, CPU, lr_warmup_epochs=2.0).schedule
            == "dense for the first 2 epoch(s) (the learning rate's warm-up), then density 0.1")
    assert (build_communicator({"strategy": "csc", "csc_warmup_epochs": 1.5}, CPU, lr_warmup_epochs=2.0).schedule
            == "dense for the first 1.5 epoch(s) (comm.csc_warmup_epochs), then density 0.1")
    assert build_communicator({"strategy": "gradientflow"}, CPU).schedule == "sparse from the first step: density 0.1"
    assert (build_communicator({"strategy": "gradientflow", "density_ramp_epochs": 3}, CPU).schedule
            == "sparse from the first step: density 0.1, falling to it over 3 epoch(s)")
    assert build_communicator({"strategy": "lazy"}, CPU, lr_warmup_epochs=2.0).schedule == ""


def test_a_checkpoint_resumes_only_under_the_dense_warmup_it_was_saved_with() -> None:
    """The warm-up follows optim.warmup_epochs by default: a resume that changed that alone would move
    CSC's switch to sparse (or send a sparse run back to dense) unannounced, so it is refused, naming
    the setting that keeps the saved one; the same warm-up, or a state saved before it was kept, loads."""
    from gradientflow_repro.checkpoint import CheckpointError
    from gradientflow_repro.comm.factory import build_communicator

    def attached(lr_warmup: float) -> CSCCommunicator:
        comm = build_communicator({"strategy": "gradientflow", "bucket_mb": 0.004}, CPU, lr_warmup_epochs=lr_warmup)
        model = TwoLayerNet()
        comm.attach(model, _optimizer_of("lars", model))
        return comm

    saved = attached(2.0).state_dict()
    assert saved["warmup_epochs"] == 2.0
    attached(2.0).load_state_dict(saved)
    with pytest.raises(CheckpointError, match=r"dense warm-up was 2 epochs when this checkpoint was saved, now it "
                                              r"is 5 .* resume with comm.csc_warmup_epochs=2 to keep"):
        attached(5.0).load_state_dict(saved)
    attached(5.0).load_state_dict({key: value for key, value in saved.items() if key != "warmup_epochs"})


def test_a_csc_built_directly_is_refused_by_the_declared_checks() -> None:
    """Built without the factory, CSC refuses a bad ``comm.*`` value with the rule and words declared
    on ``CSCKeys``' fields (csc/__init__.py), not a second copy of the rule."""
    import dataclasses
    import re

    from gradientflow_repro.comm.csc import CSCKeys

    declared = {spec.name: spec.metadata["check"].says for spec in dataclasses.fields(CSCKeys)}
    for key, value in (("density", 1.5), ("density", 0.0), ("density_ramp_epochs", -1), ("release_cap", -1.0),
                       ("release_cap", math.inf), ("release_cap", math.nan), ("chunk_size", 0)):
        options = {"chunk_size": 100, "density": 0.1, key: value}
        with pytest.raises(ValueError, match=re.escape(f"config key 'comm.{key}' = {value!r}: {declared[key]}")):
            CSCCommunicator(CPU, builtin_sum(), 4096, overlap=False, warmup_epochs=1.0, **options)


def test_release_cap_holds_back_what_exceeds_it() -> None:
    """A chosen chunk sends at most cap x the norm of this step's addition; the rest stays in its
    residual (held back + sent = the chunk); chunks under the cap are sent whole and cleared, and so
    is a chunk this step added nothing to (capped at 0 it would stay chosen forever)."""
    chunks, chunk_size, cap = 6, 10, 2.0
    state = BucketState.zeros(chunks, chunk_size, CPU)
    residual = torch.zeros(chunks, chunk_size)
    residual[0], residual[3] = 5.0, 0.1  # chunk 0 waited long (sent capped), chunk 3 little (sent whole)
    residual[5] = -9.0  # and nothing added to it this step
    state.residual.copy_(residual)
    gradient = torch.full((chunks, chunk_size), 0.5)
    gradient[1:3] = gradient[5] = 0.0
    sent = state.sparsify(gradient, 0.5, lambda tensor, stats: None, lambda tensor, stats: None, CommStats(),
                          release_cap=cap)
    state.commit()
    accumulated = residual + gradient
    assert sent.chosen.tolist() == [0, 3, 5]  # the largest norms: 90, 55, 6
    step_norm = gradient[0].norm()
    assert sent.summed[0].norm() == pytest.approx(cap * step_norm.item(), rel=1e-6)  # capped
    assert torch.allclose(sent.summed[0] + state.residual[0], accumulated[0], atol=1e-6)  # nothing lost
    assert torch.equal(sent.summed[1:], accumulated[[3, 5]])  # under the cap, or nothing added: whole
    assert torch.equal(state.residual[[3, 5]], torch.zeros(2, chunk_size))
    assert torch.equal(state.residual[[1, 2, 4]], accumulated[[1, 2, 4]])  # not chosen: kept whole
    with pytest.raises(ValueError, match="comm.release_cap"):
        CSCCommunicator(CPU, builtin_sum(), 4096, overlap=False, chunk_size=100, density=0.1,
                        warmup_epochs=1.0, release_cap=-1.0)
    with pytest.raises(ValueError, match="comm.release_cap"):
        CSCCommunicator(CPU, builtin_sum(), 4096, overlap=False, chunk_size=100, density=0.1,
                        warmup_epochs=1.0, release_cap=math.inf)


@pytest.mark.parametrize("world, release_cap", [(2, 0.0), (3, 0.0), (4, 0.0), (3, 1.0)])
def test_same_chunks_everywhere_and_nothing_lost(world: int, release_cap: float, tmp_path: Path) -> None:
    spawn_checked(check_csc_selection_and_no_loss, world, tmp_path, release_cap)


def _density_one_is_dense(rank: int, world: int, out: str) -> None:
    sparse_model, dense_model = TwoLayerNet(), TwoLayerNet()
    sparse, dense = csc(density=1.0, momentum_correction=True), LazyAllreduce(
        CPU, builtin_sum(), bucket_bytes=4096, overlap=False)
    sparse.attach(sparse_model, torch.optim.SGD(sparse_model.parameters(), lr=0.1, momentum=0.9))
    dense.attach(dense_model)
    same = True
    for step in range(3):
        for model, comm in ((sparse_model, sparse), (dense_model, dense)):
            comm.begin_step(epoch=5.0)
            backward(model, rank, step)
            comm.synchronize()
            comm.end_step(True)
        for a, b in zip(sparse_model.parameters(), dense_model.parameters()):
            same &= torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-7)
        sparse_model.zero_grad(set_to_none=True)
        dense_model.zero_grad(set_to_none=True)
    same &= sparse.optimizer.param_groups[0]["momentum"] == 0.9  # optimizer keeps its momentum
    torch.save(same, Path(out) / f"rank{rank}.pt")


def test_density_one_equals_dense(tmp_path: Path) -> None:
    spawn(_density_one_is_dense, 3, str(tmp_path))
    assert all(torch.load(tmp_path / f"rank{r}.pt") for r in range(3))


def _optimizer_of(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    if kind == "lars":
        return Lars(parameter_groups(model, 5e-4), lr=0.5, momentum=0.9, trust_coeff=0.06)
    return torch.optim.SGD(parameter_groups(model, 5e-2), lr=0.05, momentum=0.9)


def _momentum_correction_lockstep(rank: int, world: int, out: str, kind: str, decay_in: str = "velocity") -> None:
    """Momentum correction under Lars (or SGD with weight decay), every chunk sent, no masking, the
    same batch on every rank, an fp16-style loss scale: dense Lars (SGD) step for step, across the
    switch from the dense warm-up (the velocity carries the optimizer's momentum on). The optimizer
    is plain SGD while CSC sends sparsely, and gets its momentum and weight decay back for a dense
    phase."""
    failures, scale = [], 1024.0
    models = {name: TwoLayerNet() for name in ("sparse", "dense")}
    optimizers = {name: _optimizer_of(kind, model) for name, model in models.items()}
    comms = {"sparse": CSCCommunicator(CPU, ring_sum(segment_bytes=1024), bucket_bytes=4096, overlap=True,
                                       chunk_size=100, density=0.999, warmup_epochs=1.0,
                                       momentum_correction=True, momentum_masking=False,
                                       weight_decay_in=decay_in),
             "dense": LazyAllreduce(CPU, builtin_sum(), bucket_bytes=4096, overlap=False)}
    own = [(g["momentum"], g["weight_decay"]) for g in optimizers["sparse"].param_groups]
    for name, comm in comms.items():
        comm.attach(models[name], optimizers[name])
    for step in range(8):  # 3 steps per epoch: 3 dense, then 5 sparse
        for name, comm in comms.items():
            scaled = name == "sparse" and step >= 3  # the loss scale of fp16 training, divided out by CSC
            comm.begin_step(epoch=step / 3, grad_scale=scale if scaled else None)
            # the same batch everywhere: the ranks' gradients agree. A regression target, as
            # backward()'s loss on a normalised output has gradients of rounding size, which
            # LARS's rescaling would blow up to differences of a step's size
            batch = torch.Generator().manual_seed(step)
            x, target = torch.randn(8, 37, generator=batch), torch.randn(8, 11, generator=batch)
            ((models[name](x) - target).pow(2).mean() * (scale if scaled else 1.0)).backward()
            comm.synchronize()
            if scaled:  # what the loss scaler does before the optimizer
                for param in models[name].parameters():
                    param.grad.div_(scale)
            optimizers[name].step()
            comm.end_step(True)
            optimizers[name].zero_grad(set_to_none=True)
        for (param_name, a), b in zip(models["sparse"].named_parameters(), models["dense"].parameters()):
            if not torch.allclose(a, b, rtol=1e-5, atol=1e-7):
                failures.append(f"step {step}: {param_name} differs from dense {kind} by "
                                f"{(a - b).abs().max().item():.2e}")
    sparse, groups = comms["sparse"], optimizers["sparse"].param_groups
    if sparse.local_step is None or sparse.chunks(sparse.buckets[0]).shape[0] < 2:
        failures.append("the test does not exercise LocalStep on chunks")
    if [(g["momentum"], g["weight_decay"]) for g in groups] != [(0.0, 0.0), (0.0, 0.0)]:
        failures.append(f"sparse phase: the optimizer still has {[(g['momentum'], g['weight_decay']) for g in groups]}")
    if [(g["momentum"], g["weight_decay"]) for g in sparse.optimizer_settings()] != own:
        failures.append("optimizer_settings() does not give the groups' own settings")
    sparse.begin_step(epoch=0.0)  # a dense phase: everything handed back
    if [(g["momentum"], g["weight_decay"]) for g in groups] != own:
        failures.append(f"dense phase: the optimizer got back {[(g['momentum'], g['weight_decay']) for g in groups]}")
    for comm in comms.values():
        comm.close()
    save_failures(failures, out, rank)


@pytest.mark.parametrize("world,kind,decay_in", [(2, "lars", "velocity"), (3, "lars", "velocity"),
                                                (3, "sgd", "velocity"), (2, "sgd", "local"), (3, "sgd", "local")])
def test_momentum_correction_is_the_dense_optimizer_when_everything_is_sent(world: int, kind: str, decay_in: str,
                                                                           tmp_path: Path) -> None:
    """Also with weight decay in a velocity of its own on each rank (``comm.weight_decay_in=local``,
    SGD only: under LARS it is refused, ``tests/test_csc_choices.py``): with everything sent and the
    ranks agreeing, the two velocities add up to dense SGD's."""
    spawn_checked(_momentum_correction_lockstep, world, tmp_path, kind, decay_in)


REFUSED = {"adam": lambda params: torch.optim.Adam(params),
           "nesterov": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True),
           "dampening": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, dampening=0.1),
           "trust_clip": lambda params: Lars(params, lr=0.1, momentum=0.9, trust_clip=True)}


@pytest.mark.parametrize("optimizer", REFUSED.values(), ids=REFUSED.keys())
def test_momentum_correction_refuses_what_it_would_run_wrongly(optimizer) -> None:
    model = TwoLayerNet()
    with pytest.raises(ValueError, match="momentum correction"):
        csc(density=0.25, momentum_correction=True, overlap=False).attach(model, optimizer(model.parameters()))
    csc(density=0.25, momentum_correction=False, overlap=False).attach(model, optimizer(model.parameters()))


def _checkpoint_and_skip(rank: int, world: int, out: str) -> None:
    """Under Lars, so the trust ratio's noise estimate is part of the state."""
    model = TwoLayerNet()
    optimizer = _optimizer_of("lars", model)
    comm = csc(density=0.25, momentum_correction=True)
    comm.attach(model, optimizer)
    for step in range(3):
        comm.begin_step(epoch=1.0)
        backward(model, rank, step)
        comm.synchronize()
        comm.end_step(True)
        model.zero_grad(set_to_none=True)
    failures = []
    if optimizer.param_groups[0]["momentum"] != 0.0:
        failures.append("momentum correction on, but the optimizer still applies momentum")
    buffer = io.BytesIO()
    torch.save(comm.state_dict(), buffer)
    buffer.seek(0)
    restored_model = TwoLayerNet()
    restored_model.load_state_dict(model.state_dict())
    restored = csc(density=0.25, momentum_correction=True)
    restored.attach(restored_model, _optimizer_of("lars", restored_model))
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    noise = [part.noise for part in comm.parts if part.noise is not None]
    if not noise or not all((n > 0).all() for n in noise):
        failures.append("the test does not exercise the noise estimate")
    if not all(b.noise is not None and torch.equal(a.noise, b.noise)
               for a, b in zip(comm.parts, restored.parts) if a.noise is not None):
        failures.append("noise estimate not restored exactly")
    if restored.local_step.noise.step != comm.local_step.noise.step or comm.local_step.noise.step != 3:
        failures.append(f"the sketch's shift: {comm.local_step.noise.step} steps, restored "
                        f"{restored.local_step.noise.step}")
    for i in comm.residual:
        if not torch.equal(comm.residual[i], restored.residual[i]):
            failures.append(f"residual {i} not restored exactly")
    for i in comm.velocity:
        if not torch.equal(comm.velocity[i], restored.velocity[i]):
            failures.append(f"velocity {i} not restored exactly")
    # both continue in lockstep
    for m, c in ((model, comm), (restored_model, restored)):
        c.begin_step(epoch=1.0)
        backward(m, rank, 10)
        c.synchronize()
        c.end_step(True)
    if not all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), restored_model.parameters())):
        failures.append("restored communicator does not step in lockstep")
    # a skipped step (fp16 overflow on some rank) leaves residuals and velocities untouched
    before = {i: t.clone() for i, t in comm.residual.items()}
    noise_before = [None if part.noise is None else part.noise.clone() for part in comm.parts]
    comm.begin_step(epoch=1.0, grad_scale=1024.0)
    if rank == world - 1:  # the gradient overflows inside backward, on one rank only
        hook = model.a.weight.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("inf")))
    backward(model, rank, 11)
    if rank == world - 1:
        hook.remove()
    comm.synchronize()
    if all(torch.isfinite(p.grad).all() for p in model.parameters()):
        failures.append("the inf on one rank did not reach this rank's gradients")
    comm.end_step(applied=False)
    if any(not torch.equal(before[i], comm.residual[i]) for i in before):
        failures.append("a skipped step changed the residuals")
    if any(b is not None and not torch.equal(b, part.noise) for b, part in zip(noise_before, comm.parts)):
        failures.append("a skipped step changed the noise estimate")
    # and left nothing behind: the next step is the one the restored twin (which never saw the
    # skipped step) takes
    for m, c in ((model, comm), (restored_model, restored)):
        m.zero_grad(set_to_none=True)
        c.begin_step(epoch=1.0)
        backward(m, rank, 12)
        c.synchronize()
        c.end_step(True)
    if not all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), restored_model.parameters())):
        failures.append("after a skipped step the next step differs from one that never saw it")
    if not all(torch.equal(a.noise, b.noise) for a, b in zip(comm.parts, restored.parts) if a.noise is not None):
        failures.append("after a skipped step the noise estimate differs from one that never saw it")
    comm.close()
    restored.close()
    save_failures(failures, out, rank)


def test_checkpoint_restores_state_and_skipped_step_changes_nothing(tmp_path: Path) -> None:
    spawn_checked(_checkpoint_and_skip, 2, tmp_path)


@pytest.mark.parametrize("world", [2, 3])
def test_csc_as_a_ddp_communication_hook(world: int, tmp_path: Path) -> None:
    spawn_checked(check_ddp_csc_hook, world, tmp_path)


def _two_collectives_per_part(rank: int, world: int, out: str) -> None:
    """The full stack's CSC (fp16 wire, recursive doubling for small messages): two collectives per
    pool part, the bytes it reports are the bytes its point-to-point sends carry, the folded peak
    keeps the fp16 sum close to the fp32 one, and an overflow in a dense tail reaches every rank."""
    from gradientflow_repro.comm.compression import Fp16Wire
    from gradientflow_repro.comm.recursive_doubling import SizedSum

    sent_bytes = [0]
    real_batch = dist.batch_isend_irecv

    def counting_batch(ops):  # every byte our algorithms send goes through here
        sent_bytes[0] += sum(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend)
        return real_batch(ops)

    dist.batch_isend_irecv = counting_batch
    failures = []
    half_model, full_model = TwoLayerNet(), TwoLayerNet()
    half = CSCCommunicator(CPU, Fp16Wire(SizedSum(ring_sum(segment_bytes=1024)), world), bucket_bytes=4096,
                           overlap=True, chunk_size=100, density=0.3, warmup_epochs=0.0, momentum_correction=True)
    full = CSCCommunicator(CPU, ring_sum(segment_bytes=1024), bucket_bytes=4096, overlap=True, chunk_size=100,
                           density=0.3, warmup_epochs=0.0, momentum_correction=True)
    half.attach(half_model, _optimizer_of("lars", half_model))  # under Lars: the noise sketches ride with the norms
    full.attach(full_model, _optimizer_of("lars", full_model))
    if not any(part.noise is not None for part in half.parts):
        failures.append("no pool part sends noise sketches")
    norm_sizes, real_norm_sum = [], half.norm_sum

    def recording_norm_sum(tensor, stats):  # the norms' small message, sketches and peak included
        norm_sizes.append(tensor.numel())
        real_norm_sum(tensor, stats)

    half.norm_sum = recording_norm_sum
    modelled = pm.Strategy("gf", fusion="bucket", density=0.3, chunk_elements=100, wire_bytes=2, noise_sketch=True)
    expected_sizes = sorted(
        pm._message([pm.TensorProfile(p.numel(), 0.0, p.ndim <= 1) for p in b.params], b.flat.numel(),
                    b.sparse_elements, pm.ModelProfile(0.0, 0.0, 0.0, ()), modelled).small_bytes / 4
        for b in half.buckets if b.sparse_elements)
    if not any(b.sparse_elements and b.sparse_elements < b.flat.numel() for b in half.buckets):
        failures.append("no pool part holds both chunks and a dense tail")
    for model, comm in ((half_model, half), (full_model, full)):  # the first sparse step: same residuals
        comm.begin_step(epoch=1.0)
        sent_bytes[0] = 0  # (parts are sent during backward, by the communication thread)
        backward(model, rank, 0)
        comm.synchronize()
        comm.end_step(True)
        stats = comm.stats.take()
        if comm is half and sorted(norm_sizes) != expected_sizes:
            failures.append(f"norms' messages of {sorted(norm_sizes)} values, the model counts {expected_sizes}")
        if comm is half:
            if stats["collectives"] != 2 * len(comm.buckets):
                failures.append(f"{stats['collectives']} collectives for {len(comm.buckets)} pool parts")
            if stats["bytes"] != sent_bytes[0]:
                failures.append(f"reports {stats['bytes']} bytes, sent {sent_bytes[0]}")
    if half.last_selection.keys() != full.last_selection.keys() or any(
            not torch.equal(half.last_selection[i], full.last_selection[i]) for i in half.last_selection):
        failures.append("the fp16 wire changed which chunks were chosen")
    for a, b in zip(half_model.parameters(), full_model.parameters()):
        tolerance = 2e-3 * b.grad.abs().max().item() + 1e-7
        if not torch.allclose(a.grad, b.grad, rtol=0, atol=tolerance):
            failures.append(f"fp16 result off by {(a.grad - b.grad).abs().max():.3g} (tolerance {tolerance:.3g})")
    # an overflow in a one-dimensional tensor (the dense tail) on one rank reaches every rank
    half_model.zero_grad(set_to_none=True)
    half.begin_step(epoch=1.0)
    if rank == world - 1:
        hook = half_model.norm.bias.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("inf")))
    backward(half_model, rank, 1)
    if rank == world - 1:
        hook.remove()
    before = {i: t.clone() for i, t in half.residual.items()}
    half.synchronize()
    if torch.isfinite(half_model.norm.bias.grad).all():
        failures.append("an inf in a dense tail on one rank did not reach this rank")
    half.end_step(applied=False)
    if any(not torch.equal(before[i], half.residual[i]) for i in before):
        failures.append("a skipped step changed the residuals")
    dist.batch_isend_irecv = real_batch
    half.close()
    full.close()
    save_failures(failures, out, rank)


@pytest.mark.parametrize("world", [2, 3, 5])
def test_csc_sends_two_collectives_per_pool_part(world: int, tmp_path: Path) -> None:
    spawn_checked(_two_collectives_per_part, world, tmp_path)


def _trust_noise(rank: int, world: int, out: str) -> None:
    """The trust ratio's noise estimate (``TrustNoise``) against references computed from every
    rank's whole gradient (``dist.all_reduce``, ``dist.all_gather``)."""
    failures = []
    model = TwoLayerNet()
    comm = csc(density=0.5, momentum_correction=True, overlap=False)
    comm.attach(model, _optimizer_of("lars", model))
    noise = comm.local_step.noise
    buckets = [b for b in comm.buckets if noise.layers_in(b.index)]
    if sum(noise.layers_in(b.index) for b in buckets) != 2:
        failures.append("the two weight matrices are not both sketched")
    # 1. the sketch by hand (element j of a layer, times its sign, into bucket j mod k; then each
    # layer's squared norm), and linear: the ranks' sketches summed (as the norms' message sums
    # them) are the sketch of the summed gradients
    for bucket in buckets:
        state, layers = comm.parts[bucket.index], noise.layers_in(bucket.index)
        gradient = torch.randn(bucket.flat.numel(), generator=torch.Generator().manual_seed(rank))
        mine = noise.sketch(bucket, gradient, state)
        by_hand = []
        for index, k in noise.layers[bucket.index]:
            param, offset, _ = noise.entries[bucket.index][index]
            n = param.numel()
            signed = gradient[offset:offset + n] * noise.signs[:n].float()
            by_hand.append(torch.zeros(k).index_add_(0, torch.arange(n) % k, signed))
        if not torch.allclose(mine[layers:], torch.cat(by_hand), rtol=1e-5, atol=1e-5):
            failures.append(f"part {bucket.index}: the sketch is not the signed sum by bucket")
        if not torch.allclose(mine[:layers], torch.stack([s.square().sum() for s in by_hand]), rtol=1e-5):
            failures.append(f"part {bucket.index}: the squared norms are not the sketches'")
        summed, total = mine.clone(), gradient.clone()
        dist.all_reduce(summed)
        dist.all_reduce(total)
        of_sum = noise.sketch(bucket, total, state)
        if not torch.allclose(summed[layers:], of_sum[layers:], rtol=1e-5, atol=1e-5):
            failures.append(f"part {bucket.index}: the summed sketches are not the sketch of the sum")
    # 2. the factor c against the exact one, c^2 = mean_i |g_i|^2 / |mean g|^2, with the same running
    # means: a shared gradient plus each rank's noise, one layer noisier than the other
    exact = {}
    for step in range(40):
        for bucket in buckets:
            state = comm.parts[bucket.index]
            shared = torch.Generator().manual_seed(1000 + step)
            gradient = torch.zeros_like(bucket.flat)
            for index, _ in noise.layers[bucket.index]:
                param, offset, _ = noise.entries[bucket.index][index]
                n = param.numel()
                signal = torch.rand(n, generator=shared) + 0.5  # all positive: signs matter
                spread = 3.0 if n > 1000 else 0.5
                mine = signal + spread * torch.randn(n, generator=torch.Generator().manual_seed(rank * 7919 + step))
                gradient[offset:offset + n] = mine
                everyone = [torch.empty_like(mine) for _ in range(world)]
                dist.all_gather(everyone, mine)
                sample = torch.stack([sum(g.square().sum() for g in everyone) / world,
                                      (sum(everyone) / world).square().sum()])
                exact[index, bucket.index] = sample if step == 0 else 0.9 * exact[index, bucket.index] + 0.1 * sample
            sketch = noise.sketch(bucket, gradient, state)
            dist.all_reduce(sketch)
            noise.observe(bucket, state, sketch)
        comm.end_step(True)  # commits, and shifts the signs
    if noise.step != 40:
        failures.append(f"the signs shifted {noise.step} times in 40 steps")
    truths = []
    for bucket in buckets:
        for index, c in noise.factors(bucket, comm.parts[bucket.index]).items():
            own, mean = exact[index, bucket.index]
            truths.append(min(max((own / mean).item(), 1.0), world) ** 0.5)
            if abs(c.item() / truths[-1] - 1) > 0.2:
                failures.append(f"part {bucket.index}, layer {index}: c = {c.item():.3f}, exact {truths[-1]:.3f}")
    if max(truths) < 1.2:
        failures.append(f"exact factors {truths}: the test needs noise")
    # 2b. LocalStep gives each layer its own factor: against lars_rescale_ one layer at a time
    settings = comm.optimizer_settings()
    for bucket in buckets:
        state = comm.parts[bucket.index]
        factors = noise.factors(bucket, state)
        gradient = torch.randn(bucket.flat.numel(), generator=torch.Generator().manual_seed(50 + rank))
        expected = gradient.clone()
        for index, (param, offset, group) in enumerate(comm.local_step.entries[bucket.index]):
            view, own = expected[offset:offset + param.numel()], settings[group]
            if adapts(own):
                lars_rescale_([view], [param.detach().reshape(-1)], [own], [factors.get(index, 1.0)])
            elif own.get("weight_decay", 0.0):
                view.add_(param.detach().reshape(-1), alpha=own["weight_decay"])
        comm.local_step.apply_(bucket, gradient, settings, state)
        if not torch.allclose(gradient, expected, rtol=1e-6, atol=1e-9):
            failures.append(f"part {bucket.index}: LocalStep does not rescale each layer by its own factor")
    # 3. ranks that agree: c is 1, as dense LARS
    fresh = TwoLayerNet()
    agreeing = csc(density=0.5, momentum_correction=True, overlap=False)
    agreeing.attach(fresh, _optimizer_of("lars", fresh))
    for bucket in buckets:
        state = agreeing.parts[bucket.index]
        for step in range(3):
            gradient = torch.randn(bucket.flat.numel(), generator=torch.Generator().manual_seed(step))
            sketch = agreeing.local_step.noise.sketch(bucket, gradient, state)
            dist.all_reduce(sketch)
            agreeing.local_step.noise.observe(bucket, state, sketch)
            state.commit()
        own, mean = state.noise  # unclamped: an estimate below 1 would be wrong too
        if not torch.allclose(own / mean, torch.ones_like(own), rtol=1e-5):
            failures.append(f"ranks that agree: c^2 = {(own / mean).tolist()}, not 1")
    comm.close()
    agreeing.close()
    save_failures(failures, out, rank)


@pytest.mark.parametrize("world", [2, 3, 5])
def test_trust_noise_estimate_against_every_ranks_gradient(world: int, tmp_path: Path) -> None:
    spawn_checked(_trust_noise, world, tmp_path)


def test_trust_ratio_divides_the_gradient_norm_by_the_noise_factor() -> None:
    gradient, weight = torch.full((4,), 3.0), torch.full((4,), 2.0)  # |g| = 6, |w| = 4
    group = {"weight_decay": 0.5, "trust_coeff": 0.1, "eps": 0.0}
    lars_rescale_([gradient], [weight], [group], noise=[torch.tensor(2.0)])
    ratio = 0.1 * 4 / (6 / 2 + 4 * 0.5)  # trust |w| / (|g| / c + wd |w|)
    assert torch.allclose(gradient, (torch.full((4,), 3.0) + 0.5 * weight) * ratio)

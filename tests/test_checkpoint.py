"""Checkpoints: atomic directories, checksums, damaged ones skipped with a warning; in gloo
processes, every rank writes and verifies its own files and all agree on the checkpoint to resume;
pickles that would run code are refused; a resume on another number of ranks follows the rule."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from gradientflow_repro import checkpoint

from conftest import spawn
from support import make_state

CPU = torch.device("cpu")


def save(run: Path, step: int, value: float, keep: int = 3) -> Path:
    return checkpoint.save_checkpoint(run, step, {"w": torch.full((3,), value)}, {"r": step},
                                      rank=0, world_size=1, barrier=lambda: None, keep=keep)


def test_latest_complete_checkpoint_is_found_and_loaded(tmp_path: Path) -> None:
    save(tmp_path, 5, 1.0)
    save(tmp_path, 10, 2.0)
    (tmp_path / "checkpoints" / "step_000000015.tmp").mkdir()  # a write that never finished
    latest = checkpoint.find_resumable(tmp_path)
    assert latest.name == "step_000000010"
    shared, mine = checkpoint.load_checkpoint(latest, rank=0, world_size=1)
    assert torch.equal(shared["w"], torch.full((3,), 2.0)) and mine == {"r": 10}


def test_only_the_last_k_are_kept(tmp_path: Path) -> None:
    for step in range(1, 6):
        save(tmp_path, step, float(step), keep=2)
    assert [p.name for p in checkpoint.complete_checkpoints(tmp_path)] == ["step_000000004", "step_000000005"]


def test_corrupted_checkpoint_is_skipped_with_a_warning_naming_it(tmp_path: Path) -> None:
    save(tmp_path, 1, 1.0)
    bad = save(tmp_path, 2, 2.0)
    with open(bad / "shared.pt", "r+b") as handle:
        handle.truncate(10)
    with pytest.warns(UserWarning, match="step_000000002"):
        assert checkpoint.find_resumable(tmp_path).name == "step_000000001"


def test_checkpoint_from_another_world_size_is_refused(tmp_path: Path) -> None:
    path = save(tmp_path, 3, 1.0)
    with pytest.raises(checkpoint.CheckpointError, match="written by 1 ranks, this job has 4"):
        checkpoint.load_checkpoint(path, rank=0, world_size=4)



# ---------------------------------------------------------------- in real gloo processes

def _parallel_save(rank: int, world: int, run: str, out: str) -> None:
    """Two checkpoints, each rank its own file; then the files each rank hashes to verify them."""
    hashed: list[str] = []
    real = checkpoint._sha256

    def recording(path: Path) -> str:
        hashed.append(Path(path).name)
        return real(path)

    checkpoint._sha256 = recording
    for step in (1, 2):
        checkpoint.save_checkpoint(Path(run), step, {"w": torch.arange(5.0) * step} if rank == 0 else None,
                                   {"r": torch.full((7,), float(rank * 10 + step))}, rank=rank, world_size=world,
                                   barrier=checkpoint.Group().barrier, keep=3)
    written_hashes = list(hashed)  # written: hashed as it was written, never read back
    found = checkpoint.find_resumable(Path(run))
    torch.save({"while_saving": written_hashes, "verified": sorted(hashed), "found": found.name},
               Path(out) / f"rank{rank}.pt")


def _resume_after_damage(rank: int, world: int, run: str, out: str) -> None:
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = checkpoint.find_resumable(Path(run))
    torch.save({"found": found.name, "warnings": [str(w.message) for w in caught]}, Path(out) / f"rank{rank}.pt")


def test_each_rank_writes_and_verifies_its_own_file_and_all_skip_a_damaged_one(tmp_path: Path) -> None:
    import hashlib
    import json

    world, run = 3, tmp_path / "run"
    spawn(_parallel_save, world, str(run), str(tmp_path))
    newest = run / "checkpoints" / "step_000000002"
    manifest = json.loads((newest / "manifest.json").read_text())
    assert manifest["world_size"] == world and set(manifest["sha256"]) == {
        "shared.pt", "rank_00000.pt", "rank_00001.pt", "rank_00002.pt"}
    for name, digest in manifest["sha256"].items():  # the digests taken while writing are the files'
        assert hashlib.sha256((newest / name).read_bytes()).hexdigest() == digest, name
        assert (newest / name).stat().st_size == manifest["bytes"][name]
    for rank in range(world):
        seen = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert seen["while_saving"] == [], f"rank {rank} read files back to hash them"
        assert seen["verified"] == sorted(["shared.pt", f"rank_{rank:05d}.pt"]), f"rank {rank}: {seen}"
        assert seen["found"] == "step_000000002"
    with open(newest / "rank_00002.pt", "r+b") as handle:  # one byte flipped in rank 2's file
        handle.seek(200)
        byte = handle.read(1)
        handle.seek(200)
        handle.write(bytes([byte[0] ^ 0xFF]))
    spawn(_resume_after_damage, world, str(run), str(tmp_path))
    for rank in range(world):
        seen = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert seen["found"] == "step_000000001", f"rank {rank}: {seen}"
        assert any("step_000000002" in w and "damaged on rank(s) [2]" in w and "rank_00002.pt" in w
                   for w in seen["warnings"]), seen["warnings"]


class _RunsCode:
    """A pickle that runs code when loaded without weights_only: it would create ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: ANN204
        return (Path.touch, (self.marker,))


def test_a_pickle_that_would_run_code_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "code_ran"
    path = checkpoint.save_checkpoint(tmp_path, 1, {"w": torch.ones(2)}, {"r": _RunsCode(marker)},
                                      rank=0, world_size=1, barrier=lambda: None, keep=1)
    assert checkpoint.find_resumable(tmp_path) == path  # intact: its checksum is right
    with pytest.raises(checkpoint.CheckpointError, match=r"rank_00000.pt holds objects that safe loading "
                                                          r"\(weights_only\) refuses"):
        checkpoint.load_checkpoint(path, rank=0, world_size=1)
    assert not marker.exists()
    with pytest.raises(checkpoint.CheckpointError, match="rank 0: .*rank_00000.pt holds objects"):
        make_state()[0].load(path)
    assert not marker.exists()


# ---------------------------------------------------------------- another number of ranks

class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(37, 53)
        self.norm = nn.BatchNorm1d(53)
        self.b = nn.Linear(53, 11)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.norm(self.a(x))))


def _trainer_parts(rank: int, world: int) -> tuple:
    """A small model under Lars and CSC with momentum correction (residual, velocity and noise
    estimate per rank), in a TrainState as the trainer builds it."""
    from gradientflow_repro.comm.csc import CSCCommunicator
    from gradientflow_repro.comm.ring import ring_sum
    from gradientflow_repro.optim import Lars, parameter_groups
    from gradientflow_repro.state import LocalBuffers, ModelWeights, TrainingProgress, TrainState, rng_parts

    model = _Net()
    optimizer = Lars(parameter_groups(model, 5e-4), lr=0.5, momentum=0.9, trust_coeff=0.06)
    comm = CSCCommunicator(CPU, ring_sum(segment_bytes=1024), bucket_bytes=4096, overlap=False, chunk_size=100,
                           density=0.25, warmup_epochs=0.0, momentum_correction=True)
    comm.attach(model, optimizer)
    progress = TrainingProgress()
    state = TrainState(shared={"model": ModelWeights(model, "net"), "optimizer": optimizer, "progress": progress},
                       per_rank={"buffers": LocalBuffers(model, world), "comm": comm, **rng_parts(CPU)},
                       rank=rank, world_size=world, device=CPU)
    return state, model, optimizer, comm, progress


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, comm, rank: int, step: int) -> None:
    """One training step through ``model`` (the communicator's wrapper, where it has one)."""
    comm.begin_step(epoch=1.0)
    x = torch.randn(16, 37, generator=torch.Generator().manual_seed(rank * 100 + step)) + rank
    model(x).pow(2).mean().backward()
    comm.synchronize()
    optimizer.step()
    comm.end_step(True)
    optimizer.zero_grad(set_to_none=True)


def _first_step_differs(resumed: tuple, reference: tuple, rank: int) -> list[str]:
    """One step on each (model, what the step runs through, optimizer, communicator); how the
    resumed model's parameters differ from the reference's after it."""
    _step(*resumed[1:], rank, 10)
    _step(*reference[1:], rank, 10)
    return [f"after the first step, {name} differs from the reference by {(a - b).abs().max():.3g}"
            for (name, a), b in zip(resumed[0].named_parameters(), reference[0].parameters())
            if not torch.allclose(a, b, rtol=1e-5, atol=1e-6)]


def _train_old(rank: int, world: int, run: str) -> None:
    state, model, optimizer, comm, progress = _trainer_parts(rank, world)
    for step in range(3):
        _step(model, optimizer, comm, rank, step)
        progress.stepped(0.1)
    torch.manual_seed(50 + rank)  # each rank's generator its own
    state.save(Path(run), 3, keep=2)


def _mean_by_hand(values: list) -> object:
    """The rule, written out: float tensors averaged (in float64), integers their mean rounded down."""
    first = values[0]
    if isinstance(first, torch.Tensor):
        if first.is_floating_point():
            return (sum(v.double() for v in values) / len(values)).to(first.dtype)
        return sum(values) // len(values)
    if isinstance(first, dict):
        return {key: _mean_by_hand([v[key] for v in values]) for key in first}
    return [_mean_by_hand([v[i] for v in values]) for i in range(len(first))]


def _resume_new(rank: int, world: int, run: str, out: str, old: int) -> None:
    from gradientflow_repro.state import derived_seed

    failures = []
    state, model, optimizer, comm, progress = _trainer_parts(rank, world)
    torch.manual_seed(999)
    resumed = state.resume(Path(run), "auto")
    rng_after_resume = torch.get_rng_state()
    # the reference the rule defines, built by hand from every old rank's file
    saved = Path(run) / "checkpoints" / "step_000000003"
    old_states = [torch.load(saved / f"rank_{r:05d}.pt", weights_only=True) for r in range(old)]
    shared = torch.load(saved / "shared.pt", weights_only=True)
    _, ref_model, ref_optimizer, ref_comm, _ = _trainer_parts(rank, world)
    ref_model.load_state_dict(shared["model"])
    ref_optimizer.load_state_dict(shared["optimizer"])
    expected_comm = {**old_states[0]["comm"],
                     **{key: _mean_by_hand([s["comm"][key] for s in old_states]) for key in ("residual", "velocity",
                                                                                             "noise")}}
    ref_comm.load_state_dict(expected_comm)
    expected_buffers = _mean_by_hand([s["buffers"] for s in old_states])
    for buffer, value in zip(ref_model.buffers(), expected_buffers):
        buffer.copy_(value)
    if progress.step != 3 or resumed is None:
        failures.append(f"resumed {resumed} at step {progress.step}")
    got = comm.state_dict()
    if not got["residual"] or not got["velocity"] or not got["noise"]:
        failures.append("the test does not exercise residual, velocity and noise")
    for key in ("residual", "velocity", "noise"):
        for index, tensor in expected_comm[key].items():
            if not torch.allclose(got[key][index], tensor, rtol=1e-5, atol=1e-7):
                failures.append(f"{key} {index} is not the mean over the old ranks")
    if got["optimizer_taken"] != old_states[0]["comm"]["optimizer_taken"] or got["noise_step"] != 3:
        failures.append("CSC's settings are not old rank 0's")
    for name, (buffer, value) in zip([n for n, _ in model.named_buffers()], zip(model.buffers(), expected_buffers)):
        if not torch.allclose(buffer, value, rtol=1e-5, atol=1e-7) or buffer.dtype != value.dtype:
            failures.append(f"buffer {name} is not the mean over the old ranks: {buffer} vs {value}")
    if rank < old:
        expected_rng = old_states[rank]["torch_rng"]
    else:
        expected_rng = torch.Generator().manual_seed(derived_seed(3, rank)).get_state()
    if not torch.equal(rng_after_resume, expected_rng):
        failures.append(f"rank {rank}'s generator is not {'old rank ' + str(rank) if rank < old else 'derived'}")
    # the first step after the resume: as from the state built by hand
    failures += _first_step_differs((model, model, optimizer, comm), (ref_model, ref_model, ref_optimizer, ref_comm),
                                    rank)
    torch.save({"failures": failures, "said": state.regrouped}, Path(out) / f"rank{rank}.pt")


@pytest.mark.parametrize("old,new", [(4, 2), (2, 3)])
def test_resume_on_another_number_of_ranks_follows_the_rule(old: int, new: int, tmp_path: Path) -> None:
    run = tmp_path / "run"
    spawn(_train_old, old, str(run))
    spawn(_resume_new, new, str(run), str(tmp_path), old)
    for rank in range(new):
        seen = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert seen["failures"] == [], f"rank {rank}: {seen['failures']}"
    said = torch.load(tmp_path / "rank0.pt", weights_only=True)["said"]
    assert said.startswith(f"resumed {old}-rank checkpoint on {new} ranks: BatchNorm buffers"), said
    assert f"CSC residual, CSC age, CSC velocity, CSC noise averaged over the {old} old ranks" in said, said
    assert ("rank 2 seeded from (step, rank)" in said) == (new > old), said


def test_the_trainer_resumes_on_fewer_ranks_and_says_what_it_did(tmp_path: Path, digits_root: Path) -> None:
    from conftest import FAST, train

    common = [*FAST, f"data.root={digits_root}", "global_batch_size=128", "epochs=2", "optim.warmup_epochs=1",
              "comm=gradientflow", "comm.chunk_size=4096"]
    train(4, [*common, "max_steps=15"], tmp_path)  # in the sparse phase (epoch 2)
    output = train(2, [*common, "max_steps=16"], tmp_path)
    assert "resumed from" in output and "at step 15" in output, output[-3000:]
    assert ("resumed 4-rank checkpoint on 2 ranks: BatchNorm buffers (num_batches_tracked: the mean rounded "
            "down), CSC residual, CSC age, CSC velocity, CSC noise averaged over the 4 old ranks") in output, \
        output[-3000:]
    assert (tmp_path / "checkpoints" / "step_000000016").is_dir()


def _powersgd_parts(rank: int, world: int) -> tuple:
    """The small model under DDP with PyTorch's PowerSGD hook (error feedback, warm start), in a
    TrainState as the trainer builds it."""
    from gradientflow_repro.comm.ddp import PowerSGDCommunicator
    from gradientflow_repro.state import ModelWeights, TrainingProgress, TrainState

    model = _Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    comm = PowerSGDCommunicator(CPU, rank=2, warmup_epochs=0.0)
    wrapped = comm.attach(model, optimizer)
    progress = TrainingProgress()
    state = TrainState(shared={"model": ModelWeights(model, "net"), "optimizer": optimizer, "progress": progress},
                       per_rank={"comm": comm}, rank=rank, world_size=world, device=CPU)
    return state, model, wrapped, optimizer, comm, progress


def _powersgd_old(rank: int, world: int, run: str) -> None:
    state, _, wrapped, optimizer, comm, progress = _powersgd_parts(rank, world)
    for step in range(4):  # torch's hook compresses from its third iteration: the error is kept
        _step(wrapped, optimizer, comm, rank, step)
        progress.stepped(0.1)
    state.save(Path(run), 4, keep=1)


def _powersgd_new(rank: int, world: int, run: str, out: str, old: int) -> None:
    failures = []
    state, model, wrapped, optimizer, comm, progress = _powersgd_parts(rank, world)
    resumed = state.resume(Path(run), "auto")
    saved = Path(run) / "checkpoints" / "step_000000004"
    old_states = [torch.load(saved / f"rank_{r:05d}.pt", weights_only=True)["comm"] for r in range(old)]
    shared = torch.load(saved / "shared.pt", weights_only=True)
    # the reference the rule defines, built by hand: the error averaged, the rest old rank 0's
    _, ref_model, ref_wrapped, ref_optimizer, ref_comm, _ = _powersgd_parts(rank, world)
    ref_model.load_state_dict(shared["model"])
    ref_optimizer.load_state_dict(shared["optimizer"])
    expected = {**old_states[0], "error": _mean_by_hand([s["error"] for s in old_states])}
    ref_comm.load_state_dict(expected)
    if resumed is None or progress.step != 4:
        failures.append(f"resumed {resumed} at step {progress.step}")
    got = comm.state_dict()
    if not expected["error"] or all(torch.equal(e, old_states[0]["error"][i]) for i, e in expected["error"].items()):
        failures.append("the test does not exercise PowerSGD's error on differing ranks")
    for index, tensor in expected["error"].items():
        if not torch.allclose(got["error"][index], tensor, rtol=1e-5, atol=1e-7):
            failures.append(f"error {index} is not the mean over the old ranks")
    if (got["iteration"], got["start_iteration"]) != (old_states[0]["iteration"], old_states[0]["start_iteration"]):
        failures.append("PowerSGD's counters are not old rank 0's")
    if not all(torch.equal(got["q"][i], q) for i, q in old_states[0]["q"].items()):
        failures.append("PowerSGD's Q is not old rank 0's")
    # the first step after the resume: as from the state built by hand
    failures += _first_step_differs((model, wrapped, optimizer, comm),
                                    (ref_model, ref_wrapped, ref_optimizer, ref_comm), rank)
    torch.save({"failures": failures, "said": state.regrouped}, Path(out) / f"rank{rank}.pt")


def test_powersgd_resumes_on_another_number_of_ranks_by_its_rule(tmp_path: Path) -> None:
    run = tmp_path / "run"
    spawn(_powersgd_old, 2, str(run))
    spawn(_powersgd_new, 3, str(run), str(tmp_path), 2)
    for rank in range(3):
        seen = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert seen["failures"] == [], f"rank {rank}: {seen['failures']}"
    said = torch.load(tmp_path / "rank0.pt", weights_only=True)["said"]
    assert said.startswith("resumed 2-rank checkpoint on 3 ranks: PowerSGD error averaged over the 2 old ranks; "
                           "PowerSGD iteration"), said


def test_per_rank_state_without_a_rule_is_refused_naming_both_world_sizes(tmp_path: Path) -> None:
    """A 2-rank checkpoint whose per-rank part has no rule, resumed on 1 rank: refused, naming the
    world sizes, the file and the part, before anything loads."""
    import hashlib
    import json

    from gradientflow_repro.state import Value

    state, model, *_ = make_state()
    state.per_rank["plain"] = Value(lambda: torch.zeros(2), lambda value: None)  # no rank_rule
    path = tmp_path / "checkpoints" / "step_000000003"
    path.mkdir(parents=True)
    torch.save(state.shared_state(), path / "shared.pt")
    for rank in range(2):
        torch.save(state.rank_state(), path / f"rank_{rank:05d}.pt")
    names = ["shared.pt", "rank_00000.pt", "rank_00001.pt"]
    digests = {name: hashlib.sha256((path / name).read_bytes()).hexdigest() for name in names}
    (path / "manifest.json").write_text(json.dumps({"step": 3, "world_size": 2, "sha256": digests}))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    changed = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(checkpoint.CheckpointError, match=r"rank 0: .*rank_00000.pt: written by 2 ranks, this job "
                                                         r"has 1, and per-rank part 'plain' has no rule"):
        state.resume(tmp_path, "auto")
    assert any(not torch.equal(before[k], v) for k, v in changed.items())
    assert all(torch.equal(model.state_dict()[k], v) for k, v in changed.items())  # nothing loaded

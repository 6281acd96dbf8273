"""The GPU-cluster path, checked without a GPU: what `sbatch slurm/alexnet_512gpu.sh` would meet.

- ranks per node come from the launcher (Slurm's tasks per node, not only torchrun's variable), so
  ``comm=hierarchical`` is two-level under ``srun``;
- every index tensor ``csc_hook`` uses lives on the bucket's device;
- the communication thread adopts the rank's GPU before it touches a stream (else every rank makes a
  context on GPU 0);
- ``make reproduce`` gives each rank its own local rank (its GPU with ``device=cuda``);
- fewer GPUs than ranks, or two ranks on one GPU, is an error naming the setting, on every rank,
  before NCCL starts;
- nothing in the fp16 wire, CSC or the CSC hook reads a value back to the host (under NCCL that
  would make every message wait for the GPU).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

from gradientflow_repro.comm.base import CommStats, communication_thread
from gradientflow_repro.comm.compression import Fp16Wire
from gradientflow_repro.comm.csc import CSCCommunicator, select_chunks
from gradientflow_repro.comm.factory import build_communicator
from gradientflow_repro.comm.hierarchical import HierarchicalSum
from gradientflow_repro.comm.hooks import CSCHookState, _one_dimensional_chunks, csc_hook
from gradientflow_repro.comm.ring import ring_sum
from gradientflow_repro.distributed import (
    World,
    WorldError,
    check_one_rank_per_gpu,
    discover_world,
    gpu_index,
    slurm_tasks_per_node,
)

from conftest import REPO, free_port, save_failures, spawn_checked


# ---------------------------------------------------------------- ranks per node from Slurm
@pytest.mark.parametrize("env,expected", [
    ({"SLURM_NTASKS_PER_NODE": "8"}, 8),
    ({"SLURM_STEP_TASKS_PER_NODE": "4(x16)", "SLURM_TASKS_PER_NODE": "8(x8)"}, 4),  # the step's
    ({"SLURM_TASKS_PER_NODE": "2(x3)"}, 2),  # sbatch --ntasks=6 --nodes=3, no --ntasks-per-node
    ({}, 1),
])
def test_slurm_tasks_per_node(env: dict, expected: int) -> None:
    assert slurm_tasks_per_node(env) == expected


def test_nodes_with_different_task_counts_are_named() -> None:
    with pytest.raises(WorldError, match="SLURM_STEP_TASKS_PER_NODE='2,1'"):
        slurm_tasks_per_node({"SLURM_STEP_TASKS_PER_NODE": "2,1"})


def _slurm_env(rank: int, world: int, per_node: int, cyclic: bool = False) -> dict[str, str]:
    nodes = world // per_node
    local = rank // nodes if cyclic else rank % per_node
    return {"SLURM_PROCID": str(rank), "SLURM_NTASKS": str(world), "SLURM_LOCALID": str(local),
            "SLURM_STEP_TASKS_PER_NODE": f"{per_node}(x{nodes})", "SLURM_JOB_NODELIST": "gpu[1-9]",
            "MASTER_ADDR": "127.0.0.1"}


def _hierarchical_under_srun(rank: int, world: int, out: str) -> None:
    launcher = discover_world(_slurm_env(rank, world, per_node=2))
    comm = build_communicator({"strategy": "hierarchical"}, torch.device("cpu"),
                              launcher.local_world_size, launcher.local_rank)
    failures = []
    large = comm.sum_fn.large  # small messages go by recursive doubling, large ones two-level
    if not isinstance(large, HierarchicalSum) or large.nodes != world // 2:
        failures.append(f"not two-level: {getattr(large, 'nodes', large)} node(s)")
    mine = torch.randn(1001, generator=torch.Generator().manual_seed(rank))
    reference = mine.clone()
    dist.all_reduce(reference)
    comm.sum_fn(mine, CommStats())
    if not torch.allclose(mine, reference, atol=1e-5):
        failures.append("hierarchical sum differs from all_reduce")
    # a round-robin layout (srun --distribution=cyclic) cannot be cut into node blocks: refused
    cyclic = discover_world(_slurm_env(rank, world, per_node=2, cyclic=True))
    try:
        build_communicator({"strategy": "hierarchical"}, torch.device("cpu"),
                           cyclic.local_world_size, cyclic.local_rank)
        failures.append("a cyclic layout was accepted")
    except ValueError as error:
        if "--distribution=block" not in str(error):
            failures.append(f"unclear error: {error}")
    save_failures(failures, out, rank)


def test_hierarchical_is_two_level_under_srun(tmp_path: Path) -> None:
    spawn_checked(_hierarchical_under_srun, 4, tmp_path)


# ---------------------------------------------------------------- devices
class _Bucket:
    """What csc_hook reads of a DDP GradBucket."""

    def __init__(self, params: list[torch.Tensor], device: torch.device) -> None:
        self.params, self.device = params, device

    def parameters(self) -> list[torch.Tensor]:
        return self.params

    def buffer(self) -> torch.Tensor:
        return torch.empty(sum(p.numel() for p in self.params), device=self.device)


def test_csc_hook_indexes_on_the_bucket_s_device() -> None:
    device = torch.device("meta")  # stands in for a GPU: mixing it with CPU indices fails alike
    bucket = _Bucket([torch.empty(10, 7, device=device), torch.empty(7, device=device)], device)
    always = _one_dimensional_chunks(bucket, chunk_size=16)
    assert always.device == device
    norms = torch.empty(5, device=device)  # the summed chunk norms, on the bucket's device
    assert select_chunks(norms, 0.2, always).device == device


def test_the_communication_thread_adopts_the_rank_s_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, torch.device]] = []
    monkeypatch.setattr(torch.cuda, "set_device",
                        lambda device: calls.append((threading.current_thread().name, device)))
    executor = communication_thread(torch.device("cuda", 3))
    try:
        seen_first = executor.submit(lambda: list(calls)).result(timeout=10)
    finally:
        executor.shutdown()
    assert len(seen_first) == 1 and seen_first[0][1] == torch.device("cuda", 3), seen_first
    assert seen_first[0][0].startswith("gradientflow-comm")
    calls.clear()
    cpu = communication_thread(torch.device("cpu"))
    cpu.submit(lambda: None).result(timeout=10)
    cpu.shutdown()
    assert calls == []


def test_reproduce_gives_each_rank_its_local_rank(tmp_path: Path) -> None:
    from gradientflow_repro.cluster import launch

    probe = ("import os; print('[probe]', os.environ['LOCAL_RANK'], os.environ['LOCAL_WORLD_SIZE'], "
             "flush=True)")
    launch.run_ranks(3, [], tmp_path, "probe", None, timeout_s=60, show=False, module=("-c", probe))
    seen = sorted(line.split()[1:] for rank in range(3)
                  for line in (tmp_path / f"rank{rank}.log").read_text().splitlines()
                  if line.startswith("[probe]"))
    assert seen == [["0", "3"], ["1", "3"], ["2", "3"]], seen


def _world(local_rank: int, local_world_size: int) -> World:
    return World(rank=8 + local_rank, world_size=16, local_rank=local_rank,
                 local_world_size=local_world_size, master_addr="n0", master_port=1, source="slurm")


def test_each_rank_gets_its_own_gpu_or_a_clear_error() -> None:
    assert gpu_index(_world(3, 8), visible=8, cuda_visible_devices=None) == 3
    assert gpu_index(_world(3, 8), visible=1, cuda_visible_devices="3") == 0  # --gpus-per-task=1
    with pytest.raises(WorldError, match=r"local rank 5 of 8 ranks.*only 4 GPU\(s\).*--nproc-per-node"):
        gpu_index(_world(5, 8), visible=4, cuda_visible_devices="0,1,2,3")


def test_two_ranks_on_one_gpu_are_refused_by_every_rank_before_nccl() -> None:
    world_size, port = 3, free_port()
    server = dist.TCPStore("127.0.0.1", port, world_size, is_master=True, wait_for_workers=False)
    gpus = ["GPU-aaa", "GPU-bbb", "GPU-aaa"]  # ranks 0 and 2 were given the same GPU
    errors: list = [None] * world_size

    def rank_main(rank: int) -> None:
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                              timeout=datetime.timedelta(seconds=20))
        world = World(rank, world_size, rank, world_size, "127.0.0.1", port, "torchrun")
        try:
            check_one_rank_per_gpu(store, world, gpus[rank], timeout_s=20)
        except WorldError as error:
            errors[rank] = str(error)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    del server
    for rank, error in enumerate(errors):
        assert error and "both use GPU GPU-aaa" in error and "CUDA_VISIBLE_DEVICES" in error, (rank, error)
        assert ("ranks 0 and 2" in error) or ("ranks 2 and 0" in error), error


# ---------------------------------------------------------------- no host reads in the hot path
@contextlib.contextmanager
def no_host_reads() -> Iterator[None]:
    """Reading a tensor's value on the host (``item``, ``tolist``, ``bool``, ``float``, ``int``) raises:
    on a GPU each of these waits for the device."""
    def refuse(*_: object, **__: object) -> None:
        raise AssertionError("a tensor was read back to the host in the hot path")

    names = ("item", "tolist", "__bool__", "__float__", "__int__")
    saved = {name: getattr(torch.Tensor, name) for name in names}
    try:
        for name in names:
            setattr(torch.Tensor, name, refuse)
        yield
    finally:
        for name, function in saved.items():
            setattr(torch.Tensor, name, function)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(37, 53), nn.Linear(53, 11)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _hot_path(rank: int, world: int, out: str) -> None:
    failures = []
    generator = torch.Generator().manual_seed(rank)
    # the fp16 wire: scale agreed and applied on the device
    tensor = torch.randn(1000, generator=generator) * 1e-6
    reference = tensor.clone()
    dist.all_reduce(reference)
    try:
        with no_host_reads():
            Fp16Wire(ring_sum(), world)(tensor, CommStats())
    except AssertionError as error:
        failures.append(f"fp16 wire: {error}")
    if not torch.allclose(tensor, reference, rtol=0, atol=world * world * 2.0 ** -11 * 1e-6 * 5):
        failures.append("fp16 wire: wrong sum")
    # CSC with the loss scale as a device tensor
    model = _Net()
    comm = CSCCommunicator(torch.device("cpu"), ring_sum(), bucket_bytes=4096, overlap=False,
                           chunk_size=100, density=0.3, warmup_epochs=0.0, momentum_correction=False,
                           release_cap=3.0)
    comm.attach(model)
    x = torch.randn(8, 37, generator=generator)
    (model(x).pow(2).mean() * 1024).backward()
    try:
        with no_host_reads():
            comm.begin_step(1.0, torch.tensor(1024.0))
            comm.synchronize()
    except AssertionError as error:
        failures.append(f"csc: {error}")
    comm.close()
    # the CSC hook inside DDP's backward
    from torch.nn.parallel import DistributedDataParallel

    ddp_model = _Net()
    ddp = DistributedDataParallel(ddp_model, bucket_cap_mb=0.004)
    state = CSCHookState(density=0.3, chunk_size=100, dense_steps=1, sum_fn=ring_sum())
    ddp.register_comm_hook(state, csc_hook)
    for step in range(2):
        loss = ddp(torch.randn(8, 37, generator=generator)).pow(2).mean()
        try:
            with no_host_reads() if step == 1 else contextlib.nullcontext():
                loss.backward()
        except (AssertionError, RuntimeError) as error:
            failures.append(f"csc_hook: {str(error).splitlines()[0]}")
        ddp_model.zero_grad(set_to_none=True)
    save_failures(failures, out, rank)


def test_the_wire_csc_and_the_csc_hook_never_wait_for_the_device(tmp_path: Path) -> None:
    spawn_checked(_hot_path, 2, tmp_path)


# ---------------------------------------------------------------- one CUDA stack
def test_one_cuda_stack_everywhere() -> None:
    """torch's CUDA major (13 for the pinned 2.14.1) and DALI's build agree in every file that
    installs or documents the environment: two CUDA majors in one process is what this prevents."""
    import re

    if torch.version.cuda is None:
        pytest.skip("this torch build has no CUDA: nothing to agree with")
    expected = f"nvidia-dali-cuda{torch.version.cuda.split('.')[0]}0"
    files = ["requirements.txt", "pyproject.toml", "environment.yml", "README.md",
             *(f"docs/{p.name}" for p in (REPO / "docs").glob("*.md")),
             *(f"slurm/{p.name}" for p in (REPO / "slurm").glob("*.sh"))]
    for name in files:
        text = (REPO / name).read_text()
        for found in re.findall(r"nvidia-dali-cuda\d+", text):
            if name == "docs/clusters.md" and found == "nvidia-dali-cuda120":
                continue  # the CUDA 12 build, named only as the untested way for V100s (and old venvs)
            assert found == expected, f"{name} names {found}, torch is CUDA {torch.version.cuda}"
    assert expected in (REPO / "requirements.txt").read_text()
    assert expected in (REPO / "pyproject.toml").read_text()
    assert "-r requirements.txt" in (REPO / "environment.yml").read_text()


def test_cudnn_picks_its_kernels_on_gpus_unless_deterministic() -> None:
    from gradientflow_repro.train import configure_backends

    saved = torch.backends.cudnn.benchmark
    try:
        configure_backends(torch.device("cuda", 0), deterministic=False)
        assert torch.backends.cudnn.benchmark
        configure_backends(torch.device("cuda", 0), deterministic=True)
        assert not torch.backends.cudnn.benchmark
        configure_backends(torch.device("cpu"), deterministic=False)
        assert not torch.backends.cudnn.benchmark
    finally:
        torch.backends.cudnn.benchmark = saved


def test_a_launch_ends_when_its_ranks_do_even_if_a_child_holds_their_output(tmp_path: Path) -> None:
    """A process a rank starts in a session of its own (as a logger's service may) keeps rank 0's
    output pipe open after every rank has exited, and no process group kill reaches it: the launch
    must end with its ranks, not wait for that pipe to close."""
    from gradientflow_repro.cluster import launch

    marker = tmp_path / "orphan.pid"
    probe = ("import os, subprocess, sys\n"
             "print('[probe] rank', os.environ['RANK'], flush=True)\n"
             "if os.environ['RANK'] == '0':\n"
             "    orphan = subprocess.Popen(['sleep', '120'], start_new_session=True)\n"
             f"    open({str(marker)!r}, 'w').write(str(orphan.pid))\n")
    outcome: list = []

    def launch_it() -> None:
        try:
            launch.run_ranks(2, [], tmp_path, "probe", None, timeout_s=60, show=False, module=("-c", probe))
            outcome.append("returned")
        except BaseException as error:  # noqa: BLE001 (reported below)
            outcome.append(error)

    started = time.monotonic()
    thread = threading.Thread(target=launch_it, daemon=True)
    thread.start()
    try:
        thread.join(timeout=30)
        assert not thread.is_alive(), "the launch waited for a pipe held by a process its rank left behind"
        assert outcome == ["returned"], outcome
        assert time.monotonic() - started < 30
        assert "[probe] rank 0" in (tmp_path / "rank0.log").read_text()
    finally:
        if marker.exists():
            try:
                os.kill(int(marker.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass

"""On NCCL the paper's layers run over NCCL's own allreduce; ours stay the implementation on gloo.

Under the NCCL-ordering double with the process group claiming to be NCCL (``nccl_order(claim_nccl=
True)``, on gloo's CPU tensors), every preset of ``configs/comm/`` (and the fp16 wire over the lazy
pool and per tensor) is built by the factory and trained a few steps: each step must deliver what
``dist.all_reduce`` of every rank's own gradient gives (``comm_workers.check_strategy``: the
mean, or for CSC the mean of what was sent while the residuals hold the rest), and not one
point-to-point op may be issued (no ``isend``/``irecv``/``batch_isend_irecv``: a Python ring would
issue 2(N-1) groups per message). ``comm.implementation=ours`` still runs our point-to-point
algorithms there, and completes under the double. Then: which NCCL_ALGO the configuration sets (a
user's kept), the run's description, the refusal of DDP over ours on NCCL, and DDP's hook over the
backend's allreduce returning before the bucket is summed (overlap), in gloo processes.
"""

from __future__ import annotations

import copy
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from gradientflow_repro.comm import STRATEGIES, build_communicator, knobs, registry
from gradientflow_repro.comm.base import CommStats
from gradientflow_repro.comm.factory import prepare_backend
from gradientflow_repro.comm.plan import resolve
from gradientflow_repro.comm.recursive_doubling import SizedSum
from gradientflow_repro.comm.ring import ring_sum
from gradientflow_repro.distributed import WorldError
from gradientflow_repro.reproduction import lineup

from comm_workers import CPU, ThreeLayerNet, check_strategy, rank_batch, strategy_options
from conftest import FAST, save_failures, spawn_checked, train
from nccl_order import nccl_order

# every preset (the peers ddp-fp16 and powersgd, PyTorch's own hooks, included: PowerSGD's P and Q
# allreduces issued from its first allreduce's callbacks), and the fp16 wire's two ways over the
# backend's allreduce
VARIANTS = {**{name: {} for name in STRATEGIES}, "lazy+fp16": {"wire": "fp16"}, "ring+fp16": {"wire": "fp16"}}
# ours, asked for by name on NCCL: still our point-to-point algorithms (at world 4 two nodes of two)
OURS = ("gradientflow", "ring")


def _variant_options(label: str, world: int) -> dict:
    """Tiny messages, so that our algorithms (were they chosen) would send most of them by the ring,
    not only by recursive doubling (point-to-point too, which would hide a fallback to it)."""
    name = label.split("+")[0]
    return {**strategy_options(name, world), "small_message_kb": 1, **VARIANTS.get(label, {})}


def _every_preset_on_nccl(rank: int, world: int, out: str) -> None:
    failures = []
    for index, label in enumerate([*VARIANTS, *(f"ours:{name}" for name in OURS)]):
        folder = Path(out) / str(index)
        folder.mkdir(exist_ok=True)
        ours = label.startswith("ours:")
        options = _variant_options(label.removeprefix("ours:"), world)
        if ours:
            options["implementation"] = "ours"
            if world % 2 == 0:
                options["ranks_per_node"] = 2  # gradientflow's auto: the two-level ring
        with nccl_order(timeout_s=20, claim_nccl=True) as counts:
            described = build_communicator(options, CPU).summing
            check_strategy(rank, world, str(folder), options)
        everywhere = torch.tensor([counts.p2p])
        dist.all_reduce(everywhere)  # two-level: the leaders alone send point-to-point
        failures += [f"{label}: {failure}" for failure in torch.load(folder / f"rank{rank}.pt")]
        if ours and everywhere.item() == 0:
            failures.append(f"{label}: comm.implementation=ours issued no point-to-point op on NCCL")
        if not ours and counts.p2p:
            failures.append(f"{label}: {counts.p2p} point-to-point calls on NCCL ({described})")
        if not ours and not described.startswith("NCCL's allreduce (") or not counts.collectives:
            failures.append(f"{label}: described as {described!r}, {counts.collectives} collectives")
        if ours and not (described.startswith("our ") and "by recursive doubling" in described):
            failures.append(f"{label}: described as {described!r}")
    save_failures(failures, out, rank)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_preset_sums_by_nccls_allreduce_on_nccl(world: int, tmp_path: Path) -> None:
    spawn_checked(_every_preset_on_nccl, world, tmp_path)


def test_every_preset_of_configs_comm_is_in_the_double_test() -> None:
    """A YAML added to configs/comm/ is a registered strategy (``knobs.presets`` refuses it otherwise),
    so it is in VARIANTS, run under the NCCL-ordering double above at world sizes 2, 3 and 4."""
    yamls = {path.stem for path in registry.PRESET_DIR.glob("*.yaml")}
    assert yamls and yamls == set(knobs.presets()) and yamls <= set(VARIANTS)


def test_the_runs_first_lines_say_what_sums(digits_root: Path, tmp_path: Path) -> None:
    """The communication line, before the first step: ours on gloo (the flat ring, with the size up to
    which recursive doubling carries a message); on NCCL ``describe_sum`` says NCCL's allreduce
    (``test_every_preset_sums_by_nccls_allreduce_on_nccl``)."""
    output = train(2, [*FAST, f"data.root={digits_root}", "comm=ring", "epochs=1", "optim.warmup_epochs=0.5",
                           "max_steps=1"], tmp_path)
    lines = output.splitlines()
    first_step = next(i for i, line in enumerate(lines) if " step 1/" in line)
    said = [line for line in lines[:first_step] if "] communication: " in line]
    assert said and said[0].endswith("communication: ring, flat ring over 2 ranks, small messages (up to "
                                      "1024 KiB) by recursive doubling"), lines[:first_step]


def test_what_sums_on_each_backend() -> None:
    """The one mapping (knobs.summing): NCCL's allreduce by default on NCCL, ours on gloo."""
    for algorithm in ("ring", "hierarchical", "auto", "builtin"):
        on_nccl = knobs.summing(algorithm, 512, 8, "nccl")
        assert on_nccl == knobs.Summing("backend", "nccl")  # NCCL's tuner: no NCCL_ALGO of its own
    assert knobs.summing("ring", 512, 8, "nccl", "ours").how == "ring"
    assert knobs.summing("auto", 512, 8, "nccl", "ours").how == "two-level"
    assert knobs.summing("auto", 512, 8, "gloo").how == "two-level"  # gloo: ours, as measured
    assert knobs.summing("ring", 8, 4, "gloo").how == "ring"
    assert knobs.summing("ring", 8, 4, "gloo", "backend") == knobs.Summing("backend", "gloo")
    assert knobs.summing("builtin", 8, 4, "gloo", "ours").how == "backend"  # builtin is the backend's
    with pytest.raises(ValueError, match="comm.implementation"):
        resolve({"strategy": "ring", "implementation": "nccl"})


def test_no_configuration_sets_nccl_algo(monkeypatch: pytest.MonkeyPatch) -> None:
    """NCCL reads NCCL_ALGO once for the whole job: set for the ring rungs it would also send their
    small messages around a ring of all ranks, and not gradientflow's (docs/strategies.md, On NCCL).
    A user's NCCL_ALGO is kept, for every strategy alike, and the run says so."""
    import os

    cuda = torch.device("cuda", 0)  # a device object only: nothing touches a GPU
    monkeypatch.delenv("NCCL_ALGO", raising=False)
    for options in ({"strategy": "gradientflow"}, {"strategy": "ring"}, {"strategy": "lazy", "wire": "fp16"},
                    {"strategy": "ring", "implementation": "ours"}, {"strategy": "hierarchical"}):
        assert prepare_backend(options, cuda, 8) is None, options
        assert "NCCL_ALGO" not in os.environ, options
    assert prepare_backend({"strategy": "ring"}, torch.device("cpu"), 8) is None  # gloo
    assert knobs.describe_nccl_algo() == "NCCL_ALGO unset: ring or tree by size"
    monkeypatch.setenv("NCCL_ALGO", "Ring")  # a user's choice is kept, and the run says so
    assert prepare_backend({"strategy": "gradientflow"}, cuda, 8) == "Ring"
    assert os.environ["NCCL_ALGO"] == "Ring"
    assert knobs.describe_nccl_algo() == "NCCL_ALGO=Ring from the environment, for every strategy alike"


def test_the_trainer_checks_the_backend_before_it_starts_the_process_group() -> None:
    """What cannot overlap on the backend is refused before ``init_process_group`` (which creates
    NCCL's communicator eagerly, ``device_id``): the trainer calls ``prepare_backend`` before it."""
    import inspect

    from gradientflow_repro import train

    source = inspect.getsource(train._train)  # main checks the configuration, _train starts the group
    assert 0 <= source.find("prepare_backend(") < source.find("distributed.init_process_group("), source


def test_ddp_over_our_algorithms_on_nccl_is_refused_naming_the_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NCCL_ALGO", raising=False)
    options = {"strategy": "ddp", "algorithm": "ring", "implementation": "ours"}
    with pytest.raises(WorldError, match="'comm.fusion' = 'ddp' and 'comm.implementation' = 'ours'"):
        prepare_backend(options, torch.device("cuda", 0), 8)
    with pytest.raises(ValueError, match="comm.implementation=backend"):
        build_communicator(options, CPU, backend="nccl")
    prepare_backend({"strategy": "ddp", "algorithm": "ring"}, torch.device("cuda", 0), 8)  # NCCL's: fine
    knobs.check_overlap(resolve(options), "gloo")  # gloo: runs, synchronously, as measured


class _SlowAllreduce:
    """``dist.all_reduce`` whose async calls finish on a thread after ``delay_s``: a hook that waits
    for its collective would return a completed future."""

    def __init__(self, original, delay_s: float) -> None:
        self.original, self.delay_s = original, delay_s

    def __call__(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if not async_op:
            return self.original(tensor, op=op, group=group)
        future: torch.futures.Future = torch.futures.Future()
        work = self.original(tensor, op=op, group=group, async_op=True)  # issued now, in order

        def finish() -> None:
            time.sleep(self.delay_s)
            work.wait()
            future.set_result([tensor])
        threading.Thread(target=finish, daemon=True).start()
        return type("Work", (), {"get_future": lambda self: future, "wait": lambda self: future.wait()})()


def _ddp_overlaps(rank: int, world: int, out: str) -> None:
    """DDP with the fp16 wire over the backend's allreduce (gloo): each bucket's hook returns before
    its sum is done, and the gradients are the all_reduce mean (fp16 rounding). Under comm.algorithm
    builtin (ddp-fp16) the hook is PyTorch's fp16_compress_hook; under any other (ring, carried by
    the backend as on NCCL by default) it is our fp16 wire with its shared scale, so gradients far
    below fp16's smallest number still arrive (a last step at 1e-12 of the loss)."""
    from gradientflow_repro.comm import ddp

    failures = []
    for options, expected_hook in (({"strategy": "ddp", "wire": "fp16"}, "counting_fp16_compress_hook"),
                                   ({"strategy": "ddp", "algorithm": "ring", "wire": "fp16",
                                     "implementation": "backend"}, "sum_hook")):
        model = ThreeLayerNet()
        reference = copy.deepcopy(model)
        comm = build_communicator({**options, "ddp_bucket_mb": 0.004}, CPU)
        pending: list[bool] = []
        called: set[str] = set()
        real = {name: getattr(ddp, name) for name in ("counting_fp16_compress_hook", "sum_hook")}

        def watching(name):
            def hook(state, bucket):
                future = real[name](state, bucket)
                called.add(name)
                pending.append(not future.done())
                return future
            return hook
        for name in real:  # what DDPCommunicator registers
            setattr(ddp, name, watching(name))
        try:
            module = comm.attach(model)
        finally:
            for name, hook in real.items():
                setattr(ddp, name, hook)
        original = dist.all_reduce
        dist.all_reduce = _SlowAllreduce(original, 0.2)
        shared_scale = expected_hook == "sum_hook"
        try:
            for step, factor in enumerate((1.0, 1.0, 1e-12) if shared_scale else (1.0, 1.0)):
                x = rank_batch(rank, step)
                reference.zero_grad(set_to_none=True)
                (reference(x).pow(2).mean() * factor).backward()
                (module(x).pow(2).mean() * factor).backward()
                for mine, theirs in zip(model.parameters(), reference.parameters()):
                    expected = theirs.grad.clone()
                    original(expected)
                    expected /= world
                    bound = 2e-3 * world * expected.abs().max().item() + factor * 1e-6
                    if not (mine.grad - expected).abs().max() <= bound:  # flushed to 0: the whole peak
                        failures.append(f"{options} step {step} (loss x {factor:g}): not the all_reduce mean")
                model.zero_grad(set_to_none=True)
        finally:
            dist.all_reduce = original
        if called != {expected_hook}:
            failures.append(f"{options}: hooks {sorted(called)} ran, not {expected_hook}")
        if not pending or not all(pending):
            failures.append(f"{options}: a hook returned a completed future ({pending}): no overlap")
        if comm.stats.collectives == 0:
            failures.append(f"{options}: nothing counted")
    save_failures(failures, out, rank)


def test_ddp_over_the_backends_allreduce_returns_before_the_sum_is_done(tmp_path: Path) -> None:
    spawn_checked(_ddp_overlaps, 2, tmp_path)


def _ddp_hooks_on_nccl(rank: int, world: int, out: str) -> None:
    """Which hook DDP gets on NCCL, and that the model prices the same: fp32 over NCCL's allreduce
    is DDP's own hook, even with comm.algorithm=ring; the fp16 wire under comm.algorithm=builtin
    (ddp-fp16) is PyTorch's fp16_compress_hook, with no scale; under any other algorithm it is our
    fp16 wire over NCCL's allreduce, its shared scale kept."""
    from gradientflow_repro.comm.base import BuiltinSum
    from gradientflow_repro.comm.compression import Fp16Wire
    from gradientflow_repro.comm.ddp import DDPCommunicator
    from gradientflow_repro.scaling import perfmodel as pm

    failures = []
    with nccl_order(timeout_s=20, claim_nccl=True):
        for options, scaled in (({"strategy": "ddp", "algorithm": "ring"}, None), ({"strategy": "ddp-fp16"}, False),
                                ({"strategy": "ddp", "wire": "fp16"}, False),
                                ({"strategy": "ddp", "algorithm": "ring", "wire": "fp16"}, True)):
            comm = build_communicator(options, CPU)
            ours_wire = isinstance(comm.sum_fn, Fp16Wire) and isinstance(comm.sum_fn.inner, BuiltinSum)
            built = ((comm.sum_fn is None and comm.wire == "fp32") if scaled is None else
                     ours_wire if scaled else (comm.sum_fn is None and comm.wire == "fp16"))
            if not isinstance(comm, DDPCommunicator) or not built:
                failures.append(f"{options}: built {type(comm).__name__} over {comm.sum_fn!r} ({comm.wire})")
            priced = pm.Strategy.from_plan("ddp", resolve(options)).shared_scale
            if scaled is not None and priced != scaled:
                failures.append(f"{options}: the model prices shared_scale={priced}, the factory builds {scaled}")
    save_failures(failures, out, rank)


def test_ddp_on_nccl_keeps_ddps_own_hook_and_our_fp16_wires_scale(tmp_path: Path) -> None:
    spawn_checked(_ddp_hooks_on_nccl, 2, tmp_path)


# ---------------------------------------------------------------- the model prices the same choice
def test_the_model_prices_nccls_allreduce_on_a_gpu_cluster_and_ours_as_before() -> None:
    from dataclasses import replace

    from gradientflow_repro.scaling import perfmodel as pm

    gloo = pm.Network(1e8, 1e-3, ranks_per_node=4, intra_bandwidth_Bps=1e10, intra_latency_s=1e-5)
    nccl = replace(gloo, nccl=True)
    payload = 4e6
    # NCCL's ring: 2(N-1) = 14 steps, of which 2(M-1) = 2 cross the two nodes at the network's
    # latency, 12 stay inside at the intra-node latency; no recursive doubling
    ring = pm.Strategy.from_plan("ring", resolve({"strategy": "ring"}))
    assert ring.implementation == "auto" and ring.summing(8, nccl) == knobs.Summing("backend", "nccl")
    nccl_ring = 12 * 1e-5 + 2 * 1e-3 + 14 / 8 * payload / 1e8
    assert pm.nccl_allreduce_s(payload, 8, nccl, "Ring") == pytest.approx(nccl_ring)  # a user's NCCL_ALGO=Ring
    # every algorithm on NCCL: its tuner, the faster of its ring and its tree (depth log2(2) = 1)
    tree_small = 2 * (3 * 1e-5 + 1 * 1e-3) + 2 * 400 / 1e8
    for algorithm in ("ring", "auto"):
        assert pm.allreduce_s(400, 8, nccl, algorithm, implementation="auto") == pytest.approx(tree_small)
        assert pm.allreduce_s(payload, 8, nccl, algorithm, implementation="auto") == pytest.approx(
            min(nccl_ring, 2 * (3 * 1e-5 + 1e-3) + 2 * payload / 1e8))
    assert pm.allreduce_s(payload, 8, nccl, "hierarchical", implementation="auto") == pytest.approx(
        min(nccl_ring, 2 * (3 * 1e-5 + 1e-3) + 2 * payload / 1e8))
    # ours on NCCL, by name: priced as before (the hand-built Strategy's default)
    assert pm.allreduce_s(payload, 8, nccl, "ring", implementation="ours") == pm.allreduce_s(payload, 8, nccl, "ring")
    assert pm.allreduce_s(payload, 8, nccl, "ring") == pytest.approx(14 * (1e-3 + payload / 8 / 1e8))
    # gloo: auto is ours, every rung of the ladder priced exactly as before
    for label, options in lineup.LADDER.items():
        configured = pm.Strategy.from_plan(label, resolve(options))
        before = replace(configured, implementation="ours")
        profile = pm.uniform_profile([100_000, 1000, 300_000], 0.01, 0.02)
        assert pm.predict_step(profile, 8, gloo, configured) == pm.predict_step(profile, 8, gloo, before), label
    # rails: NCCL's channels use every NIC of the node; our ring crosses from one GPU, one NIC
    rails = replace(nccl, rails=4)
    assert pm.allreduce_s(payload, 8, rails, "ring", implementation="auto") == pytest.approx(nccl_ring)
    assert pm.allreduce_s(payload, 8, rails, "ring", implementation="ours") == pytest.approx(
        14 * (1e-3 + payload / 8 / (1e8 / 4)))
    assert pm.allreduce_s(payload, 8, rails, "hierarchical", implementation="ours") == pytest.approx(
        2 * (3 * 1e-5 + payload / 1e10) + 2 * (1e-3 + payload / 2 / (1e8 / 4)))
    # the counts follow: NCCL's allreduce counts the ring's 2(N-1)/N bytes, even for small messages
    small = pm.Message(ready_s=0.0, payload_bytes=400, small_bytes=0.0, local_work_s=0.0)
    assert pm._sent_bytes(small, 8, nccl, ring) == pytest.approx(14 / 8 * 400)
    assert pm._sent_bytes(small, 8, nccl, replace(ring, implementation="ours")) == pytest.approx(3 * 400)


def _small_messages_on_nccl(rank: int, world: int, out: str) -> None:
    failures = []
    for ours in (False, True):
        tensor = torch.arange(7, dtype=torch.float32) * (rank + 1) + 0.5  # odd size, below any threshold
        expected = tensor.clone()
        dist.all_reduce(expected)  # the reference, outside the double
        stats = CommStats()
        with nccl_order(timeout_s=20, claim_nccl=True) as counts:
            SizedSum(ring_sum(), threshold_bytes=1024, ours=ours)(tensor, stats)
        if not torch.equal(tensor, expected):
            failures.append(f"ours={ours}: {tensor.tolist()} != {expected.tolist()}")
        if ours and (counts.p2p == 0 or counts.collectives):
            failures.append(f"ours: recursive doubling expected ({counts.p2p} p2p, {counts.collectives} collectives)")
        if not ours and (counts.p2p or not counts.collectives):
            failures.append(f"default: NCCL's allreduce expected ({counts.p2p} p2p, {counts.collectives} collectives)")
    save_failures(failures, out, rank)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_on_nccl_small_messages_go_by_our_recursive_doubling_only_when_asked(world: int, tmp_path: Path) -> None:
    """``comm.implementation=ours`` on NCCL: our recursive doubling (point-to-point groups) for the small
    messages too, so all three of our algorithms stay selectable there; by default NCCL's allreduce."""
    spawn_checked(_small_messages_on_nccl, world, tmp_path)

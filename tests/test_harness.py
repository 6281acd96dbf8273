"""The harness as a library: the scaling model stays torch-free, its ladder and pool parts are the
communicators' own (one definition each, so they cannot drift)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from gradientflow_repro.comm.csc import CSCCommunicator
from gradientflow_repro.comm.lazy import LazyAllreduce
from gradientflow_repro.comm.plan import resolve
from gradientflow_repro.comm.pool import CSCPart, Part, csc_parts, pack_parts
from gradientflow_repro.reproduction import lineup
from gradientflow_repro.reproduction.reproduce import ladder_overrides
from gradientflow_repro.reproduction.runs import dense_warmup_epochs
from gradientflow_repro.scaling import perfmodel as pm

from conftest import REPO


def test_the_analytic_model_imports_no_torch() -> None:
    code = ("import sys; import gradientflow_repro.scaling.perfmodel as pm; pm.LADDER; "
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]


# Runs scripts/simulate_scaling.py with torch (and what imports it) unimportable: a finder first on
# sys.meta_path refuses them, as on a machine that has only the analytic model's dependencies
WITHOUT_TORCH = """
import runpy, sys
class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "torchvision", "timm"):
            raise ImportError(f"{name}: not installed on this machine")
        return None
sys.meta_path.insert(0, NoTorch())
sys.argv = ["scripts/simulate_scaling.py", *sys.argv[1:]]
try:
    runpy.run_path("scripts/simulate_scaling.py", run_name="__main__")
finally:
    assert not [m for m in sys.modules if m.split(".")[0] == "torch"]
"""


def test_the_projection_runs_without_torch_for_a_shipped_model(tmp_path) -> None:
    out = tmp_path / "vgg16"
    done = subprocess.run([sys.executable, "-c", WITHOUT_TORCH, "--model", "vgg16", "--gpus", "8,64,352",
                           "--gpus-per-node", "4", "--link-efficiency", "0.9", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "model `vgg16` at 224 pixels" in out.with_suffix(".md").read_text()
    blocked = subprocess.run([sys.executable, "-c", WITHOUT_TORCH, "--model", "resnet18", "--out", str(out)],
                             cwd=REPO, capture_output=True, text=True, timeout=300)  # not shipped: torch needed
    assert blocked.returncode == 2 and "unknown model 'resnet18'" in blocked.stderr, blocked.stderr
    assert len(blocked.stderr.strip().splitlines()) == 1


def test_the_models_ladder_is_derived_from_the_knobs_with_the_values_it_always_had() -> None:
    assert pm.LADDER == (
        pm.Strategy("allreduce", algorithm="builtin"),
        pm.Strategy("ddp", fusion="bucket", bucket_bytes=25 * 2**20, overlap=True, algorithm="builtin"),
        pm.Strategy("ring"),
        pm.Strategy("ring+fp16", wire_bytes=2),
        pm.Strategy("ring+fp16+lazy", fusion="bucket", bucket_bytes=32 * 2**20, overlap=True, wire_bytes=2),
        pm.Strategy("gradientflow", fusion="bucket", bucket_bytes=32 * 2**20, overlap=True, wire_bytes=2,
                    density=0.1, algorithm="auto"))
    assert [s.name for s in pm.LADDER] == list(lineup.LADDER)
    assert pm.Strategy.from_plan("h", resolve({"strategy": "hierarchical"})).algorithm == "hierarchical"


def test_reproduce_runs_the_knobs_ladder_and_skips_csc_warmup_only() -> None:
    assert {label: ladder_overrides(label) for label in lineup.LADDER} == {
        "allreduce": ["comm=allreduce"], "ddp": ["comm=ddp"], "ring": ["comm=ring"],
        "ring+fp16": ["comm=ring", "comm.wire=fp16"], "ring+fp16+lazy": ["comm=lazy", "comm.wire=fp16"],
        "gradientflow": ["comm=gradientflow"]}
    # trained beside the ladder for convergence only: the model's check takes the ladder alone
    assert ladder_overrides("gradientflow@0.01") == ["comm=gradientflow", "comm.density=0.01"]
    assert ladder_overrides("gradientflow-mc") == ["comm=gradientflow", "comm.momentum_correction=true",
                                                   "comm.momentum_masking=true"]
    # ... and the peers, what researchers would use instead and the paper's stack as published
    assert set(lineup.COMPARED) - set(lineup.LADDER) == {"gradientflow@0.01", "gradientflow-mc",
                                                       "gradientflow-paper", "ddp-fp16", "powersgd"}
    assert ladder_overrides("powersgd") == ["comm=powersgd"]
    # CSC's dense warm-up: the learning rate's (the presets), or comm.csc_warmup_epochs where set
    config = {"optim": {"warmup_epochs": 2.5}}
    warmups = {label: dense_warmup_epochs({"summary": {}, "comm": options, "config": config})
               for label, options in lineup.LADDER.items()}
    assert warmups == {"allreduce": 0.0, "ddp": 0.0, "ring": 0.0, "ring+fp16": 0.0, "ring+fp16+lazy": 0.0,
                       "gradientflow": 2.5}
    assert dense_warmup_epochs({"summary": {}, "config": config,
                                "comm": {"strategy": "gradientflow", "csc_warmup_epochs": 1}}) == 1.0
    assert dense_warmup_epochs({"summary": {}, "config": config,
                                "comm": {"strategy": "gradientflow", "density": 1.0}}) == 0.0  # never sparse
    assert dense_warmup_epochs({"summary": {"strategy": "csc"}}) == 0.0  # a run without its configuration


def test_pack_parts_closes_a_part_at_the_threshold() -> None:
    assert pack_parts([3, 2, 5, 1], threshold_bytes=20) == [Part((0, 1), 5), Part((2,), 5), Part((3,), 1)]
    assert pack_parts([], threshold_bytes=20) == []


def test_csc_parts_put_chunks_first_and_the_dense_tail_after() -> None:
    parts = csc_parts([3, 2, 5, 1], [False, True, False, True], threshold_bytes=20, chunk_elements=4)
    assert parts == [CSCPart((0,), (1,), 4, 2), CSCPart((2,), (), 8, 0), CSCPart((), (3,), 0, 1)]
    assert [p.elements for p in parts] == [6, 8, 1]


SIZE_LISTS = [  # (elements, multi-dimensional?) in backward order
    [(1000, True), (10, False), (3000, True), (20, False), (500, True)],
    [(5000, True), (5000, True), (7, False), (1, False), (4500, True), (2, False)],
    [(12, False), (13, False), (100_000, True)],
    [(1, True)],
]


def _params(sizes: list[tuple[int, bool]]) -> list[nn.Parameter]:
    return [nn.Parameter(torch.zeros(n, 1) if weight else torch.zeros(n)) for n, weight in sizes]


def _model_parts(sizes: list[tuple[int, bool]], strategy: pm.Strategy) -> list[tuple[list[int], int, int]]:
    profile = pm.ModelProfile(0.0, 1.0, 0.0, tuple(pm.TensorProfile(n, 0.1 * i, not weight)
                                                  for i, (n, weight) in enumerate(sizes)))
    return [([t.elements for t in tensors], elements, sparse)
            for tensors, elements, sparse in pm.pool_parts(profile, strategy)]


@pytest.mark.parametrize("sizes", SIZE_LISTS)
@pytest.mark.parametrize("bucket_bytes", [1, 4000, 16_000, 10**9])
def test_the_model_prices_the_parts_the_pools_lay_out(sizes: list[tuple[int, bool]], bucket_bytes: int) -> None:
    params = _params(sizes)
    lazy = LazyAllreduce(torch.device("cpu"), None, bucket_bytes, overlap=False)
    laid = [([p.numel() for p in b.params], b.flat.numel(), b.sparse_elements) for b in lazy.layout(params)]
    assert laid == _model_parts(sizes, pm.Strategy("lazy", fusion="bucket", bucket_bytes=bucket_bytes))
    csc = CSCCommunicator(torch.device("cpu"), None, bucket_bytes, False, chunk_size=1000, density=0.1,
                          warmup_epochs=0.0)
    laid = [([p.numel() for p in b.params], b.flat.numel(), b.sparse_elements) for b in csc.layout(params)]
    assert laid == _model_parts(sizes, pm.Strategy("csc", fusion="bucket", bucket_bytes=bucket_bytes,
                                                   density=0.1, chunk_elements=1000))

"""scripts/gpu_check.py where there is no GPU: every GPU item is SKIP, the report is still written, and
neither a missing package, an exception nor a hang in one item stops the check."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import pytest
import torch

from gradientflow_repro import gpu_check

from conftest import REPO


def result_lines(text: str) -> dict[str, tuple[str, str]]:
    """item -> (status, detail) of every ``STATUS  item: detail`` line."""
    found = {}
    for line in text.splitlines():
        status, _, rest = line.partition("  ")
        if status in ("PASS", "FAIL", "SKIP"):
            item, _, detail = rest.partition(": ")
            found[item] = (status, detail)
    return found


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine the script runs every item (minutes)")
def test_without_cuda_every_gpu_item_skips_and_the_report_is_written(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.md"
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_check.py"), "--out", str(out)],
                          capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    text = out.read_text()
    results = result_lines(text)
    assert results == result_lines(done.stdout)  # what was printed is what was written
    assert results["environment"][0] in ("PASS", "SKIP"), results["environment"]
    gpu_items = [item.name for item in gpu_check.ITEMS if item.gpus]
    assert len(gpu_items) == 6
    for name in gpu_items:
        assert results[name] == ("SKIP", "no CUDA device"), name
    assert not any(status == "FAIL" for status, _ in results.values())
    header = text.split("```")[0]
    assert f"torch {torch.__version__}" in header
    assert "- command: `" in header and "scripts/gpu_check.py --out " + str(out) in header
    assert "- git commit: " in header and "- host: " in header and "- GPUs: none" in header
    assert "exit status 0" in header
    assert out.with_suffix(".log").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="without CUDA the item skips at once")
def test_an_item_of_the_check_runs_in_a_process_of_its_own_and_reports_back() -> None:
    results = gpu_check.run_in_child(gpu_check.ITEM_BY_NAME["nccl_1rank"])
    assert [r.line() for r in results] == ["SKIP  nccl_1rank: no CUDA device"]


def test_the_communicator_item_passes_on_cpu_tensors_and_reports_every_case() -> None:
    """The item the check runs on CUDA tensors (``comm_gloo_cuda``), here on CPU tensors: each case's
    line comes back through the item's own report, each with the invariant it checks met, and the
    stack under LARS with momentum correction (and the trust ratio's noise correction) matches its CPU
    reference exactly, since here the two runs are the same computation."""
    item = gpu_check.Item("comm_gloo_cpu", gpu_check.check_communicators_on_cpu, 170, 0, "")
    results = gpu_check.run_in_child(item)
    lines = {r.item: (r.status, r.detail) for r in results}
    cases = [label for label, _ in gpu_check.COMM_CASES + gpu_check.PARITY_CASES]
    assert list(lines) == [f"comm_gloo_cpu/{label}" for label in cases], [r.line() for r in results]
    assert all(status == "PASS" for status, _ in lines.values()), [r.line() for r in results]
    assert "p.grad + residuals = accumulated gradient mean" in lines["comm_gloo_cpu/gradientflow"][1]
    parity = lines["comm_gloo_cpu/gradientflow-mc+lars vs cpu"][1]
    assert "within 0 of the largest update" in parity and "the same chunks chosen at every step" in parity
    assert re.search(r"noise correction in [1-9]\d* pool part", parity), parity


def test_the_communicator_item_needs_neither_hydra_nor_omegaconf() -> None:
    """A GPU machine may have torch and timm and nothing of the rest: what the item imports must not
    pull Hydra in (it would fail there instead of checking)."""
    code = ("import sys; sys.modules.update(hydra=None, omegaconf=None); "
            "import gradientflow_repro.comm.factory, gradientflow_repro.optim")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_what_the_items_import_needs_no_hydra_where_they_do_not_use_it() -> None:
    """The DALI item's readers (``data``, ``data.listing``) and the throughput item's CSC local work
    (``scaling.profile``) import without Hydra, OmegaConf and matplotlib (which only the trainer's
    configuration and its plot use)."""
    code = ("import sys; sys.modules.update(hydra=None, omegaconf=None, matplotlib=None); "
            "import gradientflow_repro.data, gradientflow_repro.data.listing; "
            "from gradientflow_repro.scaling.profile import sparsify_work")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_dali_item_skips_naming_dali_when_it_cannot_be_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "nvidia.dali", None)  # `import nvidia.dali` now raises ImportError
    results = gpu_check.run_here(gpu_check.ITEM_BY_NAME["dali"])
    assert [(r.status, r.item) for r in results] == [("SKIP", "dali")], results
    assert "DALI" in results[0].detail and "nvidia.dali" in results[0].detail


def test_an_exception_in_an_item_is_a_fail_line_not_a_crash() -> None:
    def broken(report: gpu_check.Reporter) -> None:
        with report.part("first"):
            report.add("PASS", "fine", "first")
        with report.part("second"):
            raise ValueError("the second part broke")
        raise RuntimeError("so did the item")

    results = gpu_check.run_here(gpu_check.Item("broken", broken, 10, 0, ""))
    assert [r.line() for r in results] == ["PASS  broken/first: fine",
                                           "FAIL  broken/second: ValueError: the second part broke",
                                           "FAIL  broken: RuntimeError: so did the item"]


def hang_with_a_grandchild(report: gpu_check.Reporter) -> None:
    """Runs in the item's own process: reports one line, starts a process of its own, then hangs."""
    report.add("PASS", "reported before hanging", "before")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    Path(os.environ["GPU_CHECK_TEST_PID_FILE"]).write_text(str(sleeper.pid))
    time.sleep(600)


def test_a_hung_item_is_killed_with_its_processes_and_keeps_its_lines(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    pid_file = tmp_path / "grandchild.pid"
    monkeypatch.setenv("GPU_CHECK_TEST_PID_FILE", str(pid_file))
    item = gpu_check.Item("sleeper", hang_with_a_grandchild, 15, 0, "")
    started = time.monotonic()
    results = gpu_check.run_in_child(item)
    assert time.monotonic() - started < 60
    assert [(r.status, r.item) for r in results] == [("PASS", "sleeper/before"), ("FAIL", "sleeper")]
    assert results[1].detail == "hung > 15 s after its line sleeper/before; killed", results[1].detail
    grandchild = int(pid_file.read_text())
    for _ in range(50):  # killed with the item's process group (reaped by init shortly after)
        if not Path(f"/proc/{grandchild}").exists() or "Z" in _state(grandchild):
            break
        time.sleep(0.1)
    else:
        os.kill(grandchild, 9)
        pytest.fail(f"the hung item's own process {grandchild} outlived it")


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].split()[0]
    except (OSError, IndexError):
        return "Z"


# ---------------------------------------------------------------------------------------------
# The check's own verdicts can fail: run on CPU (gloo) with a fault injected, it must say FAIL.

CPU_TEST_ENV = {gpu_check.TEST_DEVICE_ENV: "cpu"}


def run_check(tmp_path: Path, args: list[str], env: dict[str, str],
              timeout: float = 150) -> tuple[subprocess.CompletedProcess, dict[str, tuple[str, str]]]:
    """``python -m gradientflow_repro.gpu_check`` from the repository root, as on a bare machine."""
    out = tmp_path / "gpu_check.md"
    clean = {k: v for k, v in os.environ.items() if k not in (gpu_check.TEST_DEVICE_ENV, gpu_check.TEST_FAULT_ENV)}
    done = subprocess.run([sys.executable, "-m", "gradientflow_repro.gpu_check", "--out", str(out), *args],
                          capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          env={**clean, "OMP_NUM_THREADS": "1", **env})
    return done, result_lines(done.stdout)


def test_the_collective_items_pass_on_gloo_and_say_what_they_checked(tmp_path: Path) -> None:
    done, results = run_check(tmp_path, ["--only", "nccl_2gpu", "nccl_1rank"], CPU_TEST_ENV)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    statuses = {item: status for item, (status, _) in results.items()}
    assert statuses.pop("nccl_1rank/send/recv to self") in ("PASS", "SKIP")  # gloo refuses a self-pair
    assert set(statuses.values()) == {"PASS"}, done.stdout
    assert "nccl_2gpu/lazy vs dist.all_reduce" in results and "nccl_2gpu/the trainer's helpers" in results
    assert "nccl_1rank/all_gather_into_tensor 4 MiB (out of place)" in results
    assert "through gloo, result checked" in results["nccl_1rank/all_reduce SUM 4 MiB fp32"][1]
    header = (tmp_path / "gpu_check.md").read_text().split("```")[0]
    assert f"TEST HOOKS SET (not a check of this machine): {gpu_check.TEST_DEVICE_ENV}=cpu" in header


POOL_LINES = [f"nccl_1rank/{label} pool at world size 1 vs dist.all_reduce" for label in ("lazy", "gradientflow")]


@pytest.mark.parametrize("fault, items, failing", [
    ("wrong_sum", ["nccl_1rank", "nccl_2gpu"],
     ["nccl_1rank/all_reduce SUM 4 MiB fp32", "nccl_1rank/all_reduce SUM 8 B fp64", *POOL_LINES,
      "nccl_2gpu/ring float32", "nccl_2gpu/hierarchical (1 rank per node) float16", "nccl_2gpu/the trainer's helpers"]),
    # every rank sends the same stale pool: they agree with each other; only the reference tells
    # (the lazy item against dist.all_reduce; lazy and CSC on the communicator item against the
    # mean of the ranks' own gradients and residuals; at world size 1 against dist.all_reduce)
    ("stale_pool", ["nccl_2gpu", "nccl_1rank", "comm_gloo_cuda"],
     ["nccl_2gpu/lazy vs dist.all_reduce", *POOL_LINES, "comm_gloo_cpu/lazy", "comm_gloo_cpu/ring+fp16+lazy",
      "comm_gloo_cpu/csc", "comm_gloo_cpu/gradientflow"]),
])
def test_an_injected_fault_is_a_fail_line_and_a_non_zero_exit_status(tmp_path: Path, fault: str, items: list[str],
                                                                      failing: list[str]) -> None:
    """Each fault, injected once, turns the lines that check it to FAIL, on the bare GPU machine
    (``BARE_GPU_MACHINE_LACKS``) as everywhere."""
    env = {**CPU_TEST_ENV, gpu_check.TEST_FAULT_ENV: fault, **bare_machine(tmp_path, BARE_GPU_MACHINE_LACKS)}
    done, results = run_check(tmp_path, ["--only", *items], env, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr[-3000:]
    for item in failing:
        assert results[item][0] == "FAIL", (item, done.stdout)
    if fault == "stale_pool":  # the sums themselves are right: only the pool is stale
        assert results["nccl_2gpu/ring float32"][0] == "PASS"
        assert results["nccl_1rank/all_reduce SUM 4 MiB fp32"][0] == "PASS"
        assert results["comm_gloo_cpu/allreduce"][0] == "PASS"  # no pool
    text = (tmp_path / "gpu_check.md").read_text()
    assert "exit status 1" in text and f"{gpu_check.TEST_FAULT_ENV}={fault}" in text


def test_throughput_passes_only_above_the_papers_figure() -> None:
    assert gpu_check.PAPER_ALEXNET_IMAGES_PER_S == 3297
    assert gpu_check.throughput_verdict(3297.0) == "FAIL"
    assert gpu_check.throughput_verdict(3296.0) == "FAIL"
    assert gpu_check.throughput_verdict(3298.0) == "PASS"
    assert gpu_check.throughput_verdict(float("nan")) == "FAIL"


@pytest.mark.parametrize("name, key, tflops", [
    ("NVIDIA H100 80GB HBM3", "H100", 989), ("NVIDIA H100 PCIe", "H100 PCIe", 756), ("NVIDIA H200", "H200", 989),
    ("NVIDIA A100-SXM4-80GB", "A100", 312), ("Tesla V100-SXM2-32GB", "V100", 125), ("NVIDIA L40S", "L40S", 362),
    ("Tesla P40", "P40", 12), ("NVIDIA GeForce RTX 4090", None, None), ("NVIDIA L40", None, None)])
def test_the_throughput_bar_is_the_papers_figure_scaled_to_the_gpu_found(name: str, key: Optional[str],
                                                                         tflops: Optional[float]) -> None:
    """A tenth of 3,297 images/s x the GPU's published dense fp16 TFLOPS / the P40's 12; none for a GPU
    not in the table (its line is reported without a bar)."""
    from gradientflow_repro.gpu_check.training import fp16_tflops, throughput_bar

    bar = throughput_bar(name)
    if key is None:
        assert fp16_tflops(name) is None and bar is None
        return
    assert fp16_tflops(name) == (key, tflops)
    floor, how = bar
    assert floor == pytest.approx(0.1 * 3297 * tflops / 12)
    assert "estimate" in how and f"{tflops:g} TFLOPS" in how and "Tesla P40" in how
    assert gpu_check.throughput_verdict(floor * 1.01, floor) == "PASS"
    assert gpu_check.throughput_verdict(floor * 0.99, floor) == "FAIL"


@pytest.mark.parametrize("gpus", [1, 2, 8])
def test_item_limits_fit_the_budget_whatever_the_gpu_count_and_multi_gpu_items_run_first(gpus: int) -> None:
    """Every item runs to its limit (the worst case): the sum stays within the budget, and the items
    that need several GPUs come before those that need one."""
    runnable = [item for item in gpu_check.ITEMS if 0 < item.gpus <= gpus]
    needs = [item.gpus for item in gpu_check.ITEMS if item.gpus]
    assert needs == sorted(needs, reverse=True)
    for budget in (gpu_check.BUDGET_S, 120.0):
        left, total = budget, 0.0
        for index, item in enumerate(runnable):
            limit = gpu_check.item_limit(item, runnable[index + 1:], left)
            assert 0 < limit <= item.timeout_s
            left -= limit
            total += limit
        assert total <= budget + 1e-6, (gpus, budget, total)


@pytest.mark.parametrize("case", ["directory", "unknown item", "parent is a file", "tiny budget", "bad test fault",
                                  "unknown option"])
def test_bad_options_are_refused_in_one_line_before_any_item_runs(tmp_path: Path, case: str,
                                                                  monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "a_file").write_text("")
    args = {"directory": ["--out", str(tmp_path)],
            "unknown item": ["--only", "nccl_1rank", "nccl_3gpu", "--out", str(tmp_path / "r.md")],
            "parent is a file": ["--out", str(tmp_path / "a_file" / "r.md")],
            "tiny budget": ["--budget-s", "1", "--out", str(tmp_path / "r.md")],
            "bad test fault": ["--out", str(tmp_path / "r.md")],
            "unknown option": ["--outt", str(tmp_path / "r.md")]}[case]
    if case == "bad test fault":
        monkeypatch.setenv(gpu_check.TEST_FAULT_ENV, "wrong_summ")
    ran = []
    monkeypatch.setattr(gpu_check.runner, "run_here", lambda *a, **k: ran.append(a) or [])  # where main finds them
    monkeypatch.setattr(gpu_check.runner, "run_in_child", lambda *a, **k: ran.append(a) or [])
    assert gpu_check.main(args) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and not ran
    assert len(captured.err.strip().splitlines()) == 1 and captured.err.startswith("gpu_check: error: "), captured.err
    word = {"directory": "is a directory", "unknown item": "nccl_3gpu", "parent is a file": "cannot be written",
            "tiny budget": "--budget-s", "bad test fault": "wrong_summ", "unknown option": "--outt"}[case]
    assert word in captured.err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]  # no report, no log


def test_an_existing_directory_as_out_is_refused_by_the_script_too(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_check.py"), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 2 and done.stdout == "", done.stdout + done.stderr
    assert done.stderr.strip().splitlines() == [
        f"gpu_check: error: --out {tmp_path} is a directory: name a file (e.g. {tmp_path / 'gpu_check.md'})"]


def test_the_trainer_item_skips_naming_every_missing_package(monkeypatch: pytest.MonkeyPatch) -> None:
    for module in ("hydra", "omegaconf", "mlperf_logging"):
        monkeypatch.setitem(sys.modules, module, None)  # `import module` now raises ModuleNotFoundError
    results = gpu_check.run_here(gpu_check.ITEM_BY_NAME["trainer_fp16"])
    assert [(r.status, r.item) for r in results] == [("SKIP", "trainer_fp16")], results
    for package in ("hydra-core", "omegaconf", "mlperf-logging"):
        assert package in results[0].detail, results[0].detail


# What a bare GPU machine may lack (torch is there, and numpy): importing any of these, or a module
# under them, raises ModuleNotFoundError in every Python process that starts with this
# ``sitecustomize`` on its path, the check's children and spawned ranks included. BARE_MACHINE_LACKS:
# a machine with torch alone; BARE_GPU_MACHINE_LACKS: the machine the check is meant for (Python,
# torch and timm, which brings PyYAML, torchvision and numpy: no Hydra, OmegaConf, wandb, DALI,
# matplotlib or mlperf-logging).
BARE_MACHINE_LACKS = ("hydra", "omegaconf", "antlr4", "yaml", "wandb", "nvidia.dali", "mlperf_logging", "timm",
                      "matplotlib", "torchvision")
BARE_GPU_MACHINE_LACKS = ("hydra", "omegaconf", "antlr4", "wandb", "nvidia.dali", "matplotlib", "mlperf_logging")
# what each blocked import is called in a SKIP line (results.PACKAGES)
SKIP_NAMES = {"hydra": "hydra-core", "omegaconf": "omegaconf", "antlr4": "antlr4-python3-runtime", "wandb": "wandb",
              "nvidia.dali": "DALI", "matplotlib": "matplotlib", "mlperf_logging": "mlperf-logging"}
BLOCKER = """
import importlib.abc, sys
LACKS = {lacks!r}
class Missing(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if any(name == m or name.startswith(m + ".") for m in LACKS):
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Missing())
"""


def bare_machine(tmp_path: Path, lacks: tuple[str, ...] = BARE_MACHINE_LACKS) -> dict[str, str]:
    """The environment of a machine with torch and nothing of ``lacks``."""
    folder = tmp_path / "bare_machine"
    folder.mkdir(exist_ok=True)
    (folder / "sitecustomize.py").write_text(BLOCKER.format(lacks=lacks))
    return {"PYTHONPATH": str(folder)}


def test_mixed_precision_and_the_check_import_on_a_machine_with_only_torch(tmp_path: Path) -> None:
    """A GPU machine may have torch and nothing of the rest: the check itself imports there, and the
    fp16 step the throughput item times on AlexNet-BN (``precision.Precision``) runs there."""
    code = (
        "import sys, torch\n"
        "import gradientflow_repro.gpu_check\n"
        "from gradientflow_repro.gpu_check.training import _images_per_s\n"
        "rate, _ = _images_per_s('alexnet_bn', torch.device('cpu'), batch=2, warmup=1, timed=1)\n"
        "assert rate > 0, rate\n"
        f"lacks = {BARE_MACHINE_LACKS!r}\n"
        "loaded = [m for m in sys.modules if any(m == x or m.startswith(x + '.') for x in lacks)]\n"
        "assert not loaded, loaded\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **bare_machine(tmp_path)})
    assert done.returncode == 0, done.stderr[-2000:]


def test_on_a_machine_with_only_torch_the_torch_items_run_and_a_skip_names_what_is_missing(tmp_path: Path) -> None:
    """The same bare machine (in every process the check starts): the collectives at world size 1
    really run and pass (on gloo here, as the test device), and what needs more SKIPs naming it."""
    env = {**CPU_TEST_ENV, **bare_machine(tmp_path)}
    done, results = run_check(tmp_path, ["--only", "environment", "nccl_1rank"], env, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    collectives = {item: status for item, (status, _) in results.items()
                   if item.startswith("nccl_1rank/") and item not in ("nccl_1rank/send/recv to self", *POOL_LINES)}
    assert len(collectives) >= 10 and set(collectives.values()) == {"PASS"}, done.stdout
    for line in POOL_LINES:  # building a communicator needs timm's Lars and PyYAML's presets
        status, detail = results[line]
        assert status == "SKIP" and detail.startswith("needs ") and "which is missing" in detail, detail
    assert results["nccl_1rank/the trainer's helpers at world size 1"][0] == "PASS", done.stdout
    status, detail = results["environment/dali"]
    assert status == "SKIP" and "DALI" in detail and "nvidia.dali" in detail, detail


def test_on_the_bare_gpu_machine_every_item_runs_and_every_skip_names_what_is_missing(tmp_path: Path) -> None:
    """The machine the check is meant for (torch and timm; no Hydra, OmegaConf, wandb, DALI,
    matplotlib, in every process the check starts), the items run by the one command on their CPU
    stand-ins (the test device): no line is FAIL; every item that has a stand-in runs (the lazy pool
    and CSC through the one-rank group, AlexNet-BN NCHW and channels_last with their figures, CSC's
    local work); a GPU-only item SKIPs naming the GPU, and every other SKIP names a package this
    machine lacks and the item's code uses (the trainer's step: Hydra, not matplotlib)."""
    env = {**CPU_TEST_ENV, **bare_machine(tmp_path, BARE_GPU_MACHINE_LACKS)}
    done, results = run_check(tmp_path, [], env, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert not [line for line in done.stdout.splitlines() if line.startswith("FAIL")], done.stdout
    def item_of(line: str) -> str:  # (the communicator item names its lines by the tensors' device)
        return {"comm_gloo_cpu": "comm_gloo_cuda"}.get(line.split("/")[0], line.split("/")[0])

    for item in gpu_check.ITEMS:
        lines = {name: status for name, (status, _) in results.items() if item_of(name) == item.name}
        assert lines, (item.name, done.stdout)
        if item.on_test_cpu:
            assert "PASS" in lines.values(), (item.name, done.stdout)
    for name, (status, detail) in results.items():
        if status != "SKIP":
            continue
        item = gpu_check.ITEM_BY_NAME[item_of(name)]
        if name == "nccl_1rank/send/recv to self":  # gloo (the stand-in) has no pair to itself; NCCL has
            assert detail.startswith("refused by torch/gloo"), detail
        elif detail == "no CUDA device":
            assert item.gpus and not item.on_test_cpu, name
        else:
            named = [SKIP_NAMES[module] for module in BARE_GPU_MACHINE_LACKS if f"import {module}:" in detail]
            assert named and all(package in detail for package in named), (name, detail)
    for line in POOL_LINES:
        status, detail = results[line]
        assert status == "PASS" and "collectives through gloo" in detail and "gradientflow-comm" in detail, detail
    for part in ("alexnet_bn", "alexnet_bn channels_last"):
        status, detail = results[f"throughput/{part}"]
        assert status == "PASS" and "images/s" in detail and "aten operator calls (CPU)/step" in detail, detail
    assert "ms/step, channels_last)" in results["throughput/alexnet_bn channels_last"][1]  # as the tensors say
    assert "ms/step, NCHW)" in results["throughput/alexnet_bn"][1]
    assert results["throughput/local work beside backward"][0] == "PASS"
    status, detail = results["throughput/host syncs per step"]
    assert status == "SKIP" and "hydra-core" in detail and "matplotlib" not in detail, detail
    assert results["environment/dali"][0] == "SKIP" and "DALI" in results["environment/dali"][1]


AT_WORLD_1 = """
import datetime, torch, torch.distributed as dist
from gradientflow_repro.cluster.world import free_port
from gradientflow_repro.comm.factory import build_communicator
from gradientflow_repro.gpu_check.communicators import SmallNet
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                        timeout=datetime.timedelta(seconds=60))
grads = {}
for at_world_1 in (False, True):
    torch.manual_seed(0)
    model = SmallNet()
    comm = build_communicator({"strategy": "gradientflow", "bucket_mb": 0.001, "chunk_size": 64,
                               "csc_warmup_epochs": 0.0}, torch.device("cpu"), at_world_1=at_world_1)
    module = comm.attach(model, torch.optim.SGD(model.parameters(), lr=0.1))
    comm.begin_step(0.0, 1.0)
    module(torch.randn(16, 37, generator=torch.Generator().manual_seed(1))).pow(2).mean().backward()
    comm.synchronize()
    grads[at_world_1] = [p.grad.clone() for p in model.parameters()]
    comm.end_step(applied=True)
    comm.close()
    print(at_world_1, comm.stats.collectives, comm.summing)
dist.destroy_process_group()
# the same gradients but for the fp16 wire's rounding (at world size 1 by default there is no wire)
assert all((a - b).abs().max() <= 2e-3 * a.abs().max() for a, b in zip(grads[False], grads[True]))
"""


def test_at_world_1_the_communicators_send_through_a_one_rank_group_only_when_asked() -> None:
    """``build_communicator(..., at_world_1=True)``, the GPU check's way to drive NCCL from the pool at
    world size 1: the pool's parts and CSC's norms go through the one-rank group (with the fp16 wire
    here: ``gradientflow``), and the gradients are the default's (which sends nothing) up to the
    wire's fp16 rounding."""
    done = subprocess.run([sys.executable, "-c", AT_WORLD_1], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    (_, default_sent, _), (_, forced_sent, _) = (line.split(" ", 2) for line in done.stdout.splitlines()[-2:])
    assert int(default_sent) == 0 and int(forced_sent) >= 2, done.stdout


def test_the_trainers_step_needs_no_matplotlib(tmp_path: Path) -> None:
    """The trainer draws a plot only when a run ends: its step (``throughput``'s host-sync count)
    runs where matplotlib, wandb and DALI are missing (on the CPU: nothing to count, the steps run)."""
    code = ("import torch\n"
            "from gradientflow_repro.gpu_check.training import trainer_step_syncs\n"
            "assert trainer_step_syncs(torch.device('cpu'), 1) == (None, '')\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1",
                               **bare_machine(tmp_path, ("matplotlib", "wandb", "nvidia.dali"))})
    assert done.returncode == 0, done.stderr[-3000:]


def test_make_gpu_check_installs_nothing(tmp_path: Path) -> None:
    """Without a venv it runs the machine's python3 (or PYTHON=...); with one, the venv's python. Without
    GPU_CHECK_OUT it writes the committed results/gpu_check.md (``--report``)."""
    def dry_run(*args: str) -> list[str]:
        # under a parent make (as `make test` runs it) MAKELEVEL/MAKEFLAGS would add "Entering directory"
        env = {k: v for k, v in os.environ.items()
               if k not in ("PYTHON", "VENV", "GPU_CHECK_OUT") and not k.startswith(("MAKE", "MFLAGS"))}
        done = subprocess.run(["make", "--no-print-directory", "-n", "gpu-check", *args], cwd=REPO,
                              capture_output=True, text=True, timeout=60, env=env)
        assert done.returncode == 0, done.stderr
        return [line.strip() for line in done.stdout.splitlines() if line.strip()]

    assert dry_run(f"VENV={tmp_path / 'none'}") == ["python3 -m gradientflow_repro.gpu_check --report"]
    assert dry_run(f"VENV={tmp_path / 'none'}", "PYTHON=/opt/py/bin/python3", "ARGS=--only dali") == [
        "/opt/py/bin/python3 -m gradientflow_repro.gpu_check --report --only dali"]
    assert dry_run(f"VENV={tmp_path / 'none'}", "GPU_CHECK_OUT=/out/gpu_check.md", "ARGS=--strict") == [
        "python3 -m gradientflow_repro.gpu_check --out /out/gpu_check.md --strict"]
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "python").write_text("")
    assert dry_run(f"VENV={tmp_path / 'venv'}") == [
        f"{tmp_path / 'venv'}/bin/python -m gradientflow_repro.gpu_check --report"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine the item runs instead of skipping")
def test_a_skip_changes_the_exit_status_only_under_strict(tmp_path: Path) -> None:
    out = str(tmp_path / "r.md")
    assert gpu_check.main(["--only", "nccl_1rank", "--out", out]) == 0
    assert gpu_check.main(["--only", "nccl_1rank", "--out", out, "--strict"]) == 1
    assert "exit status 1; not checked here: nccl_1rank" in Path(out).read_text()


def test_local_work_beside_the_step_is_measured_and_on_the_cpu_takes_turns() -> None:
    """The ``throughput`` item's figure for the scaling model's ``Network.local_work_slowdown``: on
    the CPU (no side stream) the step and CSC's local work run one after the other, so the step is
    slowed by about all of the local work; a ``both`` that left the local work out would read 0."""
    import torch

    from gradientflow_repro.gpu_check.training import local_work_beside_step

    step_ms, local_ms, both_ms, slowdown = local_work_beside_step(
        "alexnet_bn", torch.device("cpu"), batch=4, image=32, width=0.25, warmup=2, timed=15)
    assert step_ms > 0 and local_ms > 0 and both_ms > step_ms
    assert 0.4 < slowdown < 2.5, (step_ms, local_ms, both_ms)


def test_by_hand_the_report_goes_under_runs_and_report_writes_the_committed_one() -> None:
    from gradientflow_repro.gpu_check import runner

    assert runner.parse_options([]).out == runner.DEFAULT_OUT
    assert runner.DEFAULT_OUT.relative_to(REPO).parts[:2] == ("results", "runs")
    assert runner.REPORT_OUT == REPO / "results" / "gpu_check.md"
    with pytest.raises(runner.BadOption, match="give --out or --report, not both"):
        runner.parse_options(["--report", "--out", "elsewhere.md"])

"""scripts/gpu_check.py where there is no GPU: every GPU item is SKIP, the report is still written, and
neither a missing package, an exception nor a hang in one item stops the check."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

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
    full stack under LARS (momentum correction, the trust ratio's noise correction) matches its CPU
    reference exactly, since here the two runs are the same computation."""
    item = gpu_check.Item("comm_gloo_cpu", gpu_check.check_communicators_on_cpu, 170, 0, "")
    results = gpu_check.run_in_child(item)
    lines = {r.item: (r.status, r.detail) for r in results}
    cases = [label for label, _ in gpu_check.COMM_CASES + gpu_check.PARITY_CASES]
    assert list(lines) == [f"comm_gloo_cpu/{label}" for label in cases], [r.line() for r in results]
    assert all(status == "PASS" for status, _ in lines.values()), [r.line() for r in results]
    assert "p.grad + residuals = accumulated gradient mean" in lines["comm_gloo_cpu/gradientflow"][1]
    parity = lines["comm_gloo_cpu/gradientflow+lars vs cpu"][1]
    assert "within 0 of the largest update" in parity and "the same chunks chosen at every step" in parity
    assert re.search(r"noise correction in [1-9]\d* pool part", parity), parity


def test_the_communicator_item_needs_neither_hydra_nor_omegaconf() -> None:
    """A GPU machine may have torch and timm and nothing of the rest: what the item imports must not
    pull Hydra in (it would fail there instead of checking)."""
    code = ("import sys; sys.modules.update(hydra=None, omegaconf=None); "
            "import gradientflow_repro.comm.factory, gradientflow_repro.optim")
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

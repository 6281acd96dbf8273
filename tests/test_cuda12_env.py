"""The CUDA 12 environment (``make venv CUDA=12``, requirements-cu12.txt) for drivers older than 580:
the same pins as the default CUDA 13 environment but for one consistent CUDA 12 stack, chosen by
one switch that the Makefile remembers."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import REPO

STACK = ("torch", "torchvision", "nvidia-dali-cuda")


def _pins(name: str) -> dict[str, str]:
    """package -> version of a requirements file's pins (comments and options left out)."""
    pins = {}
    for line in (REPO / name).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith("-"):
            package, version = line.split("==")
            pins[package] = version
    return pins


def test_cuda12_requirements_differ_from_the_default_only_in_a_consistent_cuda_stack() -> None:
    default, cu12 = _pins("requirements.txt"), _pins("requirements-cu12.txt")
    assert ({p: v for p, v in default.items() if not p.startswith(STACK)}
            == {p: v for p, v in cu12.items() if not p.startswith(STACK)}), "pins besides the CUDA stack differ"
    index = re.search(r"^--extra-index-url https://download\.pytorch\.org/whl/cu(\d+)$",
                      (REPO / "requirements-cu12.txt").read_text(), re.M)
    assert index, "no PyTorch index for the CUDA 12 build"
    cuda = index.group(1)  # e.g. 126
    assert cuda.startswith("12")
    for package in ("torch", "torchvision"):  # the default's versions, as that index's CUDA 12 build
        assert cu12[package] == f"{default[package].split('+')[0]}+cu{cuda}", (package, cu12[package])
    dali = [p for p in cu12 if p.startswith("nvidia-dali-cuda")]
    assert dali == ["nvidia-dali-cuda120"], dali  # DALI's build for CUDA 12.x
    assert cu12["nvidia-dali-cuda120"] == default["nvidia-dali-cuda130"]


@pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")
def test_make_venv_cuda_switch_picks_the_requirements_and_is_remembered(tmp_path: Path) -> None:
    def dry_run(venv: Path, *args: str) -> str:
        result = subprocess.run(["make", "-n", "venv", f"VENV={venv}", *args], cwd=REPO, capture_output=True,
                                text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        return result.stdout

    fresh = dry_run(tmp_path / "a")  # the default: CUDA 13, as before
    assert "-r requirements.txt" in fresh and "requirements-cu12.txt" not in fresh
    assert "echo 13 >" in fresh
    cu12 = dry_run(tmp_path / "b", "CUDA=12")
    assert "-r requirements-cu12.txt" in cu12 and "-r requirements.txt" not in cu12
    assert "echo 12 >" in cu12
    remembered = tmp_path / "c"
    remembered.mkdir()
    (remembered / ".cuda").write_text("12\n")  # as `make venv CUDA=12` leaves it
    assert "-r requirements-cu12.txt" in dry_run(remembered)
    refused = subprocess.run(["make", "-n", "venv", f"VENV={tmp_path / 'd'}", "CUDA=11"], cwd=REPO,
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0 and "CUDA=11" in refused.stderr

"""The scaling projection (``scaling/projection.py``, ``scripts/simulate_scaling.py``): any setup from the
command line, the paper's checks and goals, and the sensitivity table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gradientflow_repro.scaling import perfmodel as pm
from gradientflow_repro.scaling.projection import Setup, paper_check

from conftest import REPO


def test_paper_setting_meets_its_goals_and_states_its_inputs() -> None:
    lines, table = paper_check()
    text = "\n".join(lines)
    assert table["gradientflow"][-1] >= 435  # the goal at 512 GPUs (85% efficiency)
    assert "| >= 435x: met |" in text and "torch.utils.flop_counter" in text
    lazy, full = table["ring+fp16+lazy"], table["gradientflow"]
    assert all(g > d for n, g, d in zip((1, 2, 4, 8, 16, 32, 64, 128, 256, 512), full, lazy) if n >= 16)
    for row in ("2 us per message", "20 us per message", "4 GPUs per node", "GPU local work 5 ms per step"):
        assert row in text
    assert "Gbit/s effective" in text and "ms per message at 56 Gbit/s" in text  # the 2.5x baseline
    assert "| 12 | 100 | 500 |" in text  # world sizes that are not a multiple of the node size


def test_the_flop_profile_makes_alexnets_big_gradients_ready_early() -> None:
    profile = Setup().profile()
    largest = max(profile.tensors, key=lambda t: t.elements)
    assert largest.ready_s < 0.2 * profile.backward_s  # fc1: by parameter count it would be ~96%
    assert profile.sparsify_s_per_element == pytest.approx(pm.CSC_BYTES_PER_ELEMENT / pm.ASSUMED_GPU_MEMORY_BPS)


def test_any_setup_from_the_command_line(tmp_path: Path) -> None:
    out = tmp_path / "scaling_resnet18"
    done = subprocess.run([sys.executable, "scripts/simulate_scaling.py", "--model", "resnet18", "--image-size", "64",
                           "--images-per-gpu", "32", "--single-gpu-images-s", "2000", "--link-gbps", "25",
                           "--gpus-per-node", "4", "--latency-us", "5", "--strategy", "lazy", "--strategy",
                           "gradientflow", "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    text = out.with_suffix(".md").read_text()
    assert "model `resnet18`" in text and "links of 25 Gbit/s" in text and "4 GPUs per node" in text
    assert "| lazy |" in text and "| gradientflow |" in text and "| allreduce |" not in text
    assert "410.2x | " not in text.split("## Sensitivity")[0]  # no paper check for another setup
    assert out.with_suffix(".png").exists()
    bad = subprocess.run([sys.executable, "scripts/simulate_scaling.py", "--model", "no_such_net", "--out",
                          str(tmp_path / "x")], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1 and "unknown model 'no_such_net'" in bad.stderr and "Traceback" not in bad.stderr
    assert not (tmp_path / "x.md").exists()

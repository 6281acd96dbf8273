"""The scaling projection (``scaling/projection.py``, ``scripts/simulate_scaling.py``): any setup from the
command line, the paper's checks and goals, and the sensitivity table."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from gradientflow_repro import variants
from gradientflow_repro.comm.plan import resolve
from gradientflow_repro.scaling import perfmodel as pm
from gradientflow_repro.scaling.profile import (
    SHIPPED,
    SHIPPED_CLASSES,
    count_flops_per_image,
    flops_as_json,
    flops_from_json,
    flops_per_image,
    shipped_path,
)
from gradientflow_repro.scaling.projection import (
    UNEVEN_GPU_COUNTS,
    Setup,
    curves,
    paper_check,
    parse_strategies,
    uneven_counts,
)

from conftest import REPO, script_module


def test_paper_setting_meets_its_goals_and_states_its_inputs() -> None:
    lines, table = paper_check()
    text = "\n".join(lines)
    # the table the figure and the reports quote is the calibrated model's, below the ceiling in the text
    assert 290 <= table["gradientflow"][-1] < 499 and "| 499.3x |" in text
    # every goal judged on the calibrated model (results/model_check.json), never on the ceiling
    assert ">= 435x" not in text and "| band contains 410.2x: met |" in text and "torch.utils.flop_counter" in text
    assert "uncalibrated ceiling" in text and "## Sensitivity (calibrated)" in text
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
    assert bad.returncode == 2 and "unknown model 'no_such_net'" in bad.stderr and "Traceback" not in bad.stderr
    assert not (tmp_path / "x.md").exists()


# ------------------------------------------------------------------ the command line for any cluster
@pytest.fixture
def script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The script with its run folder and committed report moved under ``tmp_path``."""
    module = script_module("simulate_scaling")  # its ``main`` takes argv
    monkeypatch.setattr(module, "RUNS", tmp_path / "runs")
    monkeypatch.setattr(module, "REPORT", tmp_path / "committed" / "scaling")
    return module


def test_the_shipped_flop_counts_are_what_the_count_gives_today() -> None:
    for name, size in SHIPPED:  # a stale file (a model or torch's counter changed): rerun --shipped
        shipped = json.loads(shipped_path(name, size).read_text())
        assert shipped == flops_as_json(count_flops_per_image(name, size, SHIPPED_CLASSES), name, size,
                                        SHIPPED_CLASSES), f"{shipped_path(name, size).name} is stale"
        assert flops_per_image(name, size, SHIPPED_CLASSES) == flops_from_json(shipped)
    assert {name for name, _ in SHIPPED} >= {"alexnet_bn", "alexnet", "resnet50", "resnet101", "inception_v3",
                                             "vgg16"} and ("inception_v3", 299) in SHIPPED


def test_any_gpu_counts_and_node_size_label_their_tables(script: ModuleType, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture) -> None:
    script.main(["--gpus", "8,64,352,1024,2048", "--gpus-per-node", "4", "--strategy", "allreduce,gradientflow",
                 "--name", "four"])
    text = (tmp_path / "runs" / "four.md").read_text()
    assert text in capsys.readouterr().out and (tmp_path / "runs" / "four.png").exists()
    assert "| strategy | 8 | 64 | 352 | 1024 | 2048 |" in text
    assert "not a multiple of 4" in text and "| strategy | 6 | 50 | 250 | 1002 |" in text
    assert "multiple of 8" not in text and "at 512 GPUs" not in text and "at 2048 GPUs" in text
    assert "410.2" not in text and "the paper's" not in text  # the paper's numbers: for the paper's setup only
    assert all(n % 4 for n in uneven_counts(4, 2048)) and uneven_counts(8, 512) == UNEVEN_GPU_COUNTS
    assert uneven_counts(1, 512) == ()  # one GPU per node: every world size is a multiple


def test_the_paper_setup_keeps_its_checks_at_any_gpu_counts() -> None:
    lines, table = paper_check(Setup(), (8, 352))
    text = "\n".join(lines)
    assert "| band contains 410.2x: met |" in text and "| 8 | 352 |" in text and len(table["gradientflow"]) == 2
    assert "vs the paper's 410.2x" in text and "at 512 GPUs" in text


def test_every_option_reaches_the_model() -> None:
    paper, gradientflow = Setup(), "gradientflow"
    assert Setup(link_efficiency=0.5).network().link_efficiency == 0.5
    assert Setup(overlap_slowdown=0.2).network().overlap_slowdown == 0.2
    assert Setup(step_overhead_s=0.003).profile().step_overhead_s == 0.003
    assert paper.network().nccl and not Setup(nccl=False).network().nccl
    assert Setup(bucket_mb=8).strategy(variants.LAZY_FP16).bucket_bytes == 8 * 2**20
    assert Setup(bucket_mb=8).strategy("ddp").bucket_bytes == 8 * 2**20  # DDP's own bucket
    assert Setup(density=0.02).strategy(gradientflow).density == 0.02
    assert Setup(density=0.02).strategy(variants.LAZY_FP16).density == 1.0  # a dense strategy stays dense
    profile = paper.profile()
    at512 = curves(paper, (512,), profile)[gradientflow][0]
    for changed in (Setup(link_gbps=10), Setup(link_efficiency=0.2), Setup(step_overhead_s=0.005),
                    Setup(overlap_slowdown=0.5), Setup(density=0.5)):
        assert not changed.is_paper
        assert curves(changed, (512,))[gradientflow][0] < at512, changed
    assert not Setup(bucket_mb=1).is_paper and curves(Setup(bucket_mb=1), (512,))[gradientflow][0] != at512


def test_strategies_by_label_comma_separated_and_the_dense_two_level_one() -> None:
    assert parse_strategies("allreduce,ddp, gradientflow") == ("allreduce", "ddp", "gradientflow")
    assert parse_strategies("gradientflow, flat ring") == (variants.FLAT,)  # an old label with a comma, whole
    assert parse_strategies("lazy two-level") == ("lazy two-level",)
    with pytest.raises(ValueError, match="unknown strategy 'nope'"):
        parse_strategies("allreduce,nope")
    assert not [label for label in Setup().strategies if "," in label]  # each can be named in a list
    two_level = Setup().strategy("lazy two-level")
    assert (two_level.algorithm, two_level.wire_bytes, two_level.overlap, two_level.density) == (
        "hierarchical", 2, True, 1.0)


@pytest.mark.parametrize("args,says", [
    (["--gpus", "0,8"], "at least 1"), (["--gpus", "8,x"], "whole numbers"),
    (["--gpus", "1,4", "--gpus-per-node", "8"], "larger than the largest GPU count"),
    (["--link-gbps", "-1"], "--link-gbps must be positive"),
    (["--single-gpu-images-s", "-5"], "--single-gpu-images-s must be positive"),
    (["--link-efficiency", "1.2"], "--link-efficiency must be in (0, 1]"),
    (["--link-efficiency", "0"], "--link-efficiency must be in (0, 1]"),
    (["--density", "0"], "--density must be in (0, 1]"), (["--bucket-mb", "0"], "--bucket-mb must be positive"),
    (["--overlap-slowdown", "-0.1"], "at least 0"), (["--strategy", "nope"], "unknown strategy 'nope'"),
    (["--out", str(REPO / "results" / "scaling")], "committed reports"), (["--report", "--name", "x"], "--report"),
])
def test_a_bad_option_is_one_line_and_status_2(script: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture,
                                                args: list[str], says: str) -> None:
    with pytest.raises(SystemExit) as exited:
        script.main(args)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and says in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "runs").exists() and not (tmp_path / "committed").exists()  # nothing was written


def test_runs_go_under_runs_and_only_report_rewrites_the_committed_one(script: ModuleType, tmp_path: Path) -> None:
    script.main(["--gpus", "1,8,64"])
    written = tmp_path / "runs" / "alexnet_bn-224.md"
    assert written.exists() and not (tmp_path / "committed").exists()
    assert "# Scaling model against the paper" in written.read_text()
    script.main(["--report"])
    report = (tmp_path / "committed" / "scaling.md").read_text()
    assert "Command: `python scripts/simulate_scaling.py --report`" in report and "410.2x" in report
    assert script.REPORT == tmp_path / "committed" / "scaling"
    assert script_module("simulate_scaling").REPORT == REPO / "results" / "scaling"
    bench = (REPO / "Makefile").read_text().split("\nbench:")[1].split("\n\n")[0]
    assert "scripts/simulate_scaling.py --report" in bench


def test_the_paper_setup_carries_the_calibrated_band(script: ModuleType, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from gradientflow_repro.scaling import calibration

    band = {"command": "python scripts/model_check.py", "commit": "abc", "fit_rms_points": 1.0,
            "test_rms_points": 2.0, "paper_band": {}}  # the band's data (rendered by render/scaling.py)
    monkeypatch.setattr(calibration, "band_section", lambda: band)
    script.main(["--gpus", "8,512", "--name", "paper"])
    assert "## The paper's projection, calibrated" in (tmp_path / "runs" / "paper.md").read_text()
    script.main(["--gpus", "8,512", "--link-gbps", "100", "--name", "other"])  # not the paper's: no band
    assert "calibrated" not in (tmp_path / "runs" / "other.md").read_text()


def test_without_a_calibration_no_goal_is_judged(monkeypatch: pytest.MonkeyPatch) -> None:
    from gradientflow_repro.scaling import projection

    monkeypatch.setattr(projection, "calibrated", lambda setup, path=None: None)
    text = "\n".join(paper_check(Setup(), (8, 512))[0])
    assert "no goal is judged" in text and ": met" not in text and "(calibrated)" not in text


def test_the_peers_at_512_gpus_are_in_the_paper_setup() -> None:
    text = "\n".join(paper_check(Setup(), (8, 512))[0])
    for label in ("gradientflow", "ddp", "ddp-fp16", "powersgd"):
        assert f"| `{label}` |" in text.split("At 512 GPUs, the full stack beside DDP")[1]
    assert {"ddp-fp16", "powersgd"} <= set(Setup().strategies)  # projected by default


def _two_linear_layers(bucket_s: float = 0.01) -> pm.ModelProfile:
    """fc1 64 x 32 and fc2 8 x 16 with their biases, in backward order (fc2 first)."""
    return pm.ModelProfile(0.01, 0.02, 0.0, (pm.TensorProfile(8, bucket_s, True, 8),
                                             pm.TensorProfile(128, bucket_s, False, 8),
                                             pm.TensorProfile(64, bucket_s, True, 64),
                                             pm.TensorProfile(64 * 32, bucket_s, False, 64)),
                           low_rank_s_per_element=1e-9)


def test_powersgd_sends_rank_r_factors_by_hand_count() -> None:
    powersgd = pm.strategy_of("powersgd")
    assert (powersgd.low_rank, powersgd.fusion, powersgd.wire_bytes, powersgd.density) == (4, "bucket", 4, 1.0)
    profile = _two_linear_layers()
    # fc1: n 64, m 32, r 4: (64 + 32) 4 x 2 = 768 < 2048, compressed: P 256, Q 128 elements;
    # fc2: n 8, m 16, r 4: (8 + 16) 4 x 2 = 192 > 128, sent whole (PowerSGDState's default
    # min_compression_rate 2); the biases whole: 8 + 128 + 64 = 200
    assert pm.low_rank_split(list(profile.tensors), 4) == (200, 256, 128, 2048)
    assert pm.low_rank_split([pm.TensorProfile(128, 0.0, False, 8)], 4, 1.0) == (0, 32, 64, 128)  # at rate 1
    sent = [m.payload_bytes for m in pm.messages(profile, powersgd)]
    assert sent == [200 * 4, 256 * 4, 128 * 4]  # one bucket: the whole tensors, then P, then Q
    net = pm.Network(1e8, 1e-4)
    step = pm.predict_step(profile, 4, net, powersgd)
    assert step.bytes_per_rank == pytest.approx(2 * 3 / 4 * (200 + 256 + 128) * 4)  # the builtin's 2(N-1)/N
    dense = pm.predict_step(profile, 4, net, pm.strategy_of("ddp")).bytes_per_rank
    assert dense == pytest.approx(2 * 3 / 4 * profile.elements * 4)
    local = sum(m.local_work_s for m in pm.messages(profile, powersgd))
    assert local == pytest.approx(2048 * 1e-9)  # the compressed elements only


def test_pytorchs_fp16_hook_sends_two_bytes_and_agrees_on_no_scale() -> None:
    profile, net = _two_linear_layers(), pm.Network(1e8, 1e-4)
    hook = pm.strategy_of("ddp-fp16")
    # comm=ddp comm.wire=fp16 is the same configuration (the factory builds PyTorch's hook for both);
    # our fp16 wire under DDP is the one over our ring (sum_hook), which agrees on a scale
    same = pm.Strategy.from_plan("ddp + fp16", resolve({"strategy": "ddp", "wire": "fp16"}))
    ours = pm.Strategy.from_plan("ddp, our fp16 wire", resolve({"strategy": "ddp", "wire": "fp16",
                                                                       "algorithm": "ring"}))
    assert (hook.wire_bytes, hook.shared_scale, hook.low_rank) == (2, False, 0) and ours.shared_scale
    assert not same.shared_scale
    assert [m.small_bytes for m in pm.messages(profile, hook)] == [0.0]
    assert [m.small_bytes for m in pm.messages(profile, ours)] == [4.0]  # our wire's shared scale
    assert pm.predict_step(profile, 4, net, hook).bytes_per_rank == pytest.approx(2 * 3 / 4 * profile.elements * 2)


def test_an_unknown_pricing_rule_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import dataclasses

    from gradientflow_repro.comm import powersgd

    monkeypatch.setattr(powersgd, "SPARSIFIER", dataclasses.replace(powersgd.SPARSIFIER, pricing="magic"))
    with pytest.raises(ValueError, match="pricing rule 'magic'"):
        pm.strategy_of("powersgd")

"""``scripts/simulate_scaling.py`` projects with the calibration by default (``scaling/cli.py``), and
the scaling model's reports are data rendered in one place (``render/scaling.py``) with their
verdicts as values."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from types import ModuleType

import pytest

from gradientflow_repro import render
from gradientflow_repro.scaling import calibration as cal
from gradientflow_repro.scaling import perfmodel as pm
from gradientflow_repro.scaling.projection import projection_data
from gradientflow_repro.scaling.published import ROWS

from conftest import REPO, script_module

# Horovod 2017's ResNet-101 on 64 GPUs of 40 Gbit/s TCP (README Table B), named by its fabric and
# framework and otherwise as ``model_check.cli_command`` gives it, without the fitted terms
HOROVOD_ROW = next(r for r in ROWS if r.model == "resnet101" and r.gpus == 64 and r.fabric == "tcp40")
HOROVOD = ["--model", "resnet101", "--image-size", "224", "--gpus", "64", "--gpus-per-node", "4", "--link-gbps", "40",
           "--fabric", "tcp40", "--framework", "horovod", "--intra-node-gbytes-s", "10", "--latency-us", "30",
           "--images-per-gpu", "64", "--single-gpu-images-s", "136", "--strategy", "ddp-style bucketed builtin",
           "--nccl-algo", "Ring"]


@pytest.fixture
def script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    module = script_module("simulate_scaling")
    monkeypatch.setattr(module, "RUNS", tmp_path / "runs")
    monkeypatch.setattr(module, "REPORT", tmp_path / "committed" / "scaling")
    return module


def _efficiency(path: Path) -> float:
    data = json.loads(path.read_text())
    return data["speedup"]["ddp-style bucketed builtin"][0] / 64


def test_the_default_projection_is_the_calibrated_one_and_uncalibrated_the_ceiling(
        script: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    committed = cal.committed()
    assert committed is not None, "results/model_check.json is not written"
    params = cal.Parameters(**committed["parameters"])
    profile = cal.row_profile(HOROVOD_ROW)
    calibrated = cal.predicted_efficiency(HOROVOD_ROW, params, profile)
    ceiling = cal.predicted_efficiency(HOROVOD_ROW, cal.Parameters(), profile)
    assert ceiling - calibrated > 0.05  # the terms matter here (published: 88.9%)
    script.main([*HOROVOD, "--name", "default"])
    said = capsys.readouterr().out
    script.main([*HOROVOD, "--uncalibrated", "--name", "ceiling"])
    assert _efficiency(tmp_path / "runs" / "default.json") == pytest.approx(calibrated, abs=1e-6)
    assert _efficiency(tmp_path / "runs" / "ceiling.json") == pytest.approx(ceiling, abs=1e-6)
    # each term printed and recorded with its source: the file and what it was fitted on
    terms = {t["option"]: t for t in json.loads((tmp_path / "runs" / "default.json").read_text())["terms"]}
    assert terms["link_efficiency"]["value"] == params.link("tcp40")
    assert terms["overlap_slowdown"]["value"] == params.overlap_slowdown
    assert terms["step_overhead_s"]["value"] == params.step_overhead_s["horovod"]
    for term in terms.values():
        assert "results/model_check.json" in term["source"] and "fitted on" in term["source"]
        assert f"{term['shown']} ({term['source']})" in said
    # an option sets one term; the others stay the calibration's
    script.main([*HOROVOD, "--link-efficiency", "1", "--name", "set"])
    terms = {t["option"]: t for t in json.loads((tmp_path / "runs" / "set.json").read_text())["terms"]}
    assert terms["link_efficiency"]["source"] == "the command line"
    assert terms["overlap_slowdown"]["value"] == params.overlap_slowdown
    assert _efficiency(tmp_path / "runs" / "set.json") == pytest.approx(
        cal.predicted_efficiency(HOROVOD_ROW, replace(params, link_efficiency={"tcp40": 1.0}), profile), abs=1e-6)


def test_the_rate_names_the_fabric_only_where_one_has_it() -> None:
    assert cal.fabric_of(40) == "tcp40" and cal.fabric_of(56) == "ib56"
    assert cal.fabric_of(25) is None and cal.fabric_of(100) is None  # RoCE and TCP at 25: name one


def test_an_unfitted_framework_is_one_line_and_status_2(script: ModuleType, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exited:
        script.main(["--framework", "mxnet"])
    assert exited.value.code == 2 and "no overhead fitted for it" in capsys.readouterr().err


def test_the_papers_goals_are_values_in_the_data() -> None:
    data = projection_data()
    goals = data["checks"]["goals"]
    band = data["checks"]["band"]
    assert goals["full_stack_band_contains_paper"] == (band["gradientflow"]["low"] <= pm.PAPER_SPEEDUP
                                                       <= band["gradientflow"]["high"])
    assert goals["baseline_band_contains_paper"] == (band["allreduce"]["low"] <= pm.PAPER_BASELINE_SPEEDUP
                                                     <= band["allreduce"]["high"])
    lazy, full = data["calibrated"]["ring+fp16+lazy"], data["calibrated"]["gradientflow"]
    above = all(g > d for n, g, d in zip(data["counts"], full, lazy) if n >= 16)
    assert goals["full_stack_above_dense_lazy_from_16"] == above
    assert (goals["full_stack_band_contains_paper"], goals["full_stack_above_dense_lazy_from_16"],
            goals["baseline_band_contains_paper"]) == (True, True, False)
    assert projection_data(calibrate=False)["checks"]["goals"] is None  # the ceiling judges nothing
    for row in data["sensitivity"]["rows"]:
        assert row["above_paper"] == (row["speedup"] > pm.PAPER_SPEEDUP)


def test_the_committed_checks_verdicts_are_the_rows_own() -> None:
    data = json.loads((REPO / "results" / "model_check.json").read_text())
    for row in data["rows"]:
        if row["reported_speedup"] is None:
            assert row["within_goal"] == (abs(row["error_points"]) <= 5), row["name"]
    if "goal_met" in data:  # written by the data-first check
        assert data["goal_met"] == all(r["within_goal"] for r in data["rows"])
        assert data["rows_outside_goal"] == [r["name"] for r in data["rows"] if not r["within_goal"]]


def test_the_markdown_is_rendered_from_the_data_alone(script: ModuleType, tmp_path: Path) -> None:
    script.main(["--gpus", "1,8,64", "--name", "paper"])
    data, markdown = tmp_path / "runs" / "paper.json", tmp_path / "runs" / "paper.md"
    assert json.loads(data.read_text())["kind"] == "scaling.projection"
    written = markdown.read_text()
    assert render.render_file(data, tmp_path / "again.md").read_text() == written
    assert "## Fitted terms and their sources" in written and "| link efficiency (ib56" in written


def test_model_checks_runs_go_under_runs_unless_report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gradientflow_repro.scaling import published_check

    monkeypatch.setattr(render, "RUNS", tmp_path / "runs")
    monkeypatch.setattr(render, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(published_check, "check_document", lambda command, measure: {
        **json.loads((REPO / "results" / "model_check.json").read_text()), "command": command})
    written = published_check.main(["--no-measure"], "python scripts/model_check.py --no-measure")
    assert written == tmp_path / "runs" / "model_check" / "model_check.md" and not (tmp_path / "results").exists()
    assert published_check.main(["--report"]) == tmp_path / "results" / "model_check.md"
    assert "# The scaling model against published results" in written.read_text()

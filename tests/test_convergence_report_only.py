"""``scripts/convergence.py --report-only``: the report rewritten from kept runs whatever code
trained them (e.g. with other targets), and a clear error when a run is missing. Nothing trains."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from gradientflow_repro.reproduction import convergence


def _kept(run_dir: Path, record: dict) -> None:
    """A finished whole-schedule run of 2 epochs in ``run_dir``, trained as ``record`` says."""
    run_dir.mkdir(parents=True)
    (run_dir / "summary.json").write_text(json.dumps({"stopped_by": None, "epochs": 2, "world_size": 4,
                                                      "target_top1": None, "strategy": "ddp"}))
    (run_dir / "metrics.jsonl").write_text(json.dumps({"kind": "eval", "epoch": 1.0, "top1": 90.0}) + "\n")
    (run_dir / "config.yaml").write_text(yaml.safe_dump({"epochs": 2, "comm": {"strategy": "ddp"}}))
    (run_dir / convergence.RECORD_FILE).write_text(json.dumps(record))


def test_a_run_of_other_code_is_kept_only_for_the_report(tmp_path: Path) -> None:
    trained = {"argv": ["comm=ddp", "seed=0"], "world": 4, "code": "old"}
    _kept(tmp_path / "ddp" / "seed0", trained)
    now = {**trained, "code": "new"}
    assert convergence.kept_run(tmp_path / "ddp" / "seed0", now) is None  # changed code trains again
    assert convergence.kept_run(tmp_path / "ddp" / "seed0", now, any_code=True) is not None
    other = {**now, "argv": ["comm=ddp", "seed=1"]}  # other overrides: never the same run
    assert convergence.kept_run(tmp_path / "ddp" / "seed0", other, any_code=True) is None


def test_report_only_names_the_runs_it_lacks_and_trains_nothing(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(convergence, "machine_overrides", lambda *a, **k: [])
    monkeypatch.setattr(convergence, "run_ranks", lambda *a, **k: pytest.fail("--report-only trained"))
    with pytest.raises(ValueError, match="no finished run of ddp seed 0, ddp seed 1"):
        convergence.study(configs={"ddp": ["comm=ddp"]}, seeds=(0, 1), targets=[98.0], runs_dir=tmp_path / "runs",
                          out=tmp_path / "convergence.md", report_only=True)
    assert not (tmp_path / "convergence.md").exists()

"""The peers in the comparison (PyTorch's PowerSGD and fp16 hooks, the paper's stack as published):
their rows in every table of the report and of the convergence study, the paragraph that says where
CSC stands against them from the numbers, and results/runs.csv, the tidy table of every run. From
fixtures: nothing trains here."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Optional

import pytest

from gradientflow_repro.comm import knobs
from gradientflow_repro.reproduction import lineup

GPUS_512 = [1.0] * 9  # projection fixtures: speedups at 1..256 GPUs, then 512


def _run(label: str, seed: int, curve: list[float], step_s: float = 0.1, sparse_mb: float = 1.0,
         target: Optional[float] = 98.0, steps_per_epoch: int = 10, warmup: float = 1.0) -> dict:
    """A finished run of configuration ``label`` (``lineup.COMPARED``) as ``runs.load_run`` returns it:
    two logged intervals and one evaluation per epoch, 4 MB per step in the learning rate's warm-up
    (dense) and ``sparse_mb`` after it, stopped at ``target`` (None: the whole ``curve``)."""
    reached = next((i + 1 for i, top1 in enumerate(curve) if target is not None and top1 >= target), None)
    epochs = reached or len(curve)
    records, clock, train = [], 2.0, 0.0
    for epoch in range(1, epochs + 1):
        for half in (0.5, 1.0):
            sent = (sparse_mb if epoch > warmup else 4.0) * 1e6
            records.append({"kind": "train", "epoch": epoch - 1 + half, "step_s": step_s,
                            "sync_wait_s_per_step": 0.01, "bytes_per_step": sent})
        clock += steps_per_epoch * step_s + 0.5
        train += steps_per_epoch * step_s
        records.append({"kind": "eval", "epoch": float(epoch), "top1": curve[epoch - 1], "mlperf_s": clock,
                        "train_s": train, "step": epoch * steps_per_epoch, "eval_s": 0.5 * epoch, "startup_s": 2.0,
                        "init_s": 3.0})  # every clock, as the trainer writes them
    steps = epochs * steps_per_epoch
    at = ({"step": steps, "mlperf_s": clock, "train_s": train, "eval_s": 0.5 * epochs, "startup_s": 2.0,
           "init_s": 3.0} if reached else None)
    return {"summary": {"clocks_at_target": at, "reached_target": bool(reached), "steps": steps, "epochs": epochs,
                        "target_top1": target, "final_top1": curve[epochs - 1], "best_top1": max(curve[:epochs]),
                        "bytes_per_step": 2e6, "world_size": 4, "experiment": "digits_cpu", "git_commit": "c0ffee",
                        "images_per_s": 100.0, "sync_wait_s_per_step": 0.01, "train_s": train,
                        "clocks": {"init_s": 3.0}},
            "records": records, "config": {"seed": seed, "eval_every_epochs": 1, "optim": {"warmup_epochs": warmup}},
            "comm": dict(lineup.COMPARED[label])}


def _comparison(csc: list[float], powersgd: list[float], csc_step: float = 0.1, powersgd_step: float = 0.12) -> dict:
    """Three seeds each of gradientflow, its peers, ddp and the paper's stack, to a target of 98%."""
    return {"ddp": [_run("ddp", s, [90, 95, 98], 0.2, 4.0) for s in range(3)],
            "gradientflow": [_run("gradientflow", s, csc, csc_step, 0.5) for s in range(3)],
            "gradientflow-paper": [_run("gradientflow-paper", s, [90, 94, 96, 98], 0.1, 0.5) for s in range(3)],
            "ddp-fp16": [_run("ddp-fp16", s, [90, 95, 98], 0.15, 2.0) for s in range(3)],
            "powersgd": [_run("powersgd", s, powersgd, powersgd_step, 0.3) for s in range(3)]}


CALIBRATION = {"profile": {"forward_s": 0.01, "backward_s": 0.02, "optimizer_s": 0.001,
                           "sparsify_s_per_element": 1e-9, "wire_cast_s_per_element": 1e-10,
                           "low_rank_s_per_element": 2e-9,
                           "tensors": [[40000, 0.02, False, 200], [100, 0.02, True, 100]]}}


def _convergence_rows(final: dict[str, float], falls: Optional[dict[str, float]] = None) -> list[dict]:
    """make convergence's rows of results/runs.csv: top-1 at the end per configuration, three seeds."""
    return [{"study": "convergence", "strategy": label, "seed": seed, "final_top1": top1, "epochs_to_target": 3.0,
             "largest_fall_after_warmup": (falls or {}).get(label, 1.0), "reached_target": True, "commit": "beef"}
            for label, top1 in final.items() for seed in range(3)]


def _projection() -> dict[str, list[float]]:
    return {"gradientflow": GPUS_512 + [450.0], "ddp": GPUS_512 + [230.0], "ddp-fp16": GPUS_512 + [300.0],
            "powersgd": GPUS_512 + [380.0]}


# ---------------------------------------------------------------- the paragraph: whoever wins, it says so
def test_the_peers_paragraph_says_gradientflow_wins_where_it_does() -> None:
    from report_words import peers_section

    from gradientflow_repro.scaling.projection import GPU_COUNTS

    runs = _comparison(csc=[90, 96, 98], powersgd=[90, 95, 96, 98])
    final = {"gradientflow": 99.0, "powersgd": 98.8, "ddp-fp16": 99.2, "ddp": 99.1, "gradientflow-paper": 98.9}
    text = "\n".join(peers_section(runs, CALIBRATION, _convergence_rows(final), _projection(), GPU_COUNTS))
    rows = {row.split("|")[1].strip(): [c.strip() for c in row.strip("|").split("|")]
            for row in text.splitlines() if row.startswith("| ") and not row.startswith("| strategy")}
    assert list(rows) == ["gradientflow", "powersgd", "ddp-fp16", "ddp", "gradientflow-paper"]
    assert rows["powersgd"][1] == "rank 4" and rows["gradientflow"][1] == "0.1" and rows["ddp-fp16"][1] == "1 (dense)"
    # 2 + 3 x (10 x 0.1 + 0.5) = 6.5 s against 2 + 4 x (10 x 0.12 + 0.5) = 8.8 s and 2 + 3 x 2 = 8.0 s
    assert rows["gradientflow"][2] == "6.5 [6.5-6.5]" and rows["powersgd"][2] == "8.8 [8.8-8.8]"
    assert rows["powersgd"][3] == "4 [4-4] (3 [3-3] sparse)"
    assert rows["powersgd"][4:6] == ["120.0", "0.300"]  # step and bytes after the dense warm-up
    assert rows["powersgd"][7:] == ["98.80", "380.0x"] and rows["gradientflow-paper"][8] == "-"
    assert all(cell != "not measured" for row in rows.values() for cell in row[6:7])  # local work, measured
    assert ("`gradientflow` 6.5 s, `ddp-fp16` 8.0 s, `powersgd` 8.8 s: `gradientflow` reaches the target first "
            "(0.81x the next, `ddp-fp16`).") in text
    assert "fewest `powersgd`" in text and "shortest `gradientflow`" in text
    assert "`gradientflow` 99.00%, `powersgd` 98.80%, `ddp-fp16` 99.20%: highest `ddp-fp16`" in text
    assert "speedup `gradientflow` 450.0x, `powersgd` 380.0x, `ddp-fp16` 300.0x: highest `gradientflow`" in text
    goals = [line for line in text.splitlines() if line.startswith("- Goal:")]
    assert len(goals) == 2
    assert "against `powersgd`: time to target 0.74x (ahead), top-1 at the end +0.20 points" in goals[0]
    assert "against `ddp-fp16`: time to target 0.81x (ahead), top-1 at the end -0.20 points" in goals[0]
    assert goals[0].endswith(": met.")
    # below ddp's in the median and every seed: 6.5 / 9.5 = 0.68x = 0.50x (step) x 1.00x x 1.37x
    assert "median 0.68x = 0.50x (step) x 1.00x (epochs) x 1.37x (overhead); seed 0: 0.68x" in goals[1]
    assert goals[1].endswith(": met.")
    assert ("`gradientflow` against `gradientflow-paper` (the paper's stack as published): epochs to target 3 "
            "against 4 (medians)") in text
    assert "top-1 at the end 99.00% against 98.90% (+0.10 points seed by seed" in text


def test_the_peers_paragraph_says_so_where_a_peer_wins() -> None:
    from report_words import peers_section

    from gradientflow_repro.scaling.projection import GPU_COUNTS

    # PowerSGD reaches the target an epoch sooner and steps faster; CSC ends 0.8 points below it
    runs = _comparison(csc=[90, 95, 96, 98], powersgd=[90, 98], csc_step=0.2, powersgd_step=0.1)
    final = {"gradientflow": 98.2, "powersgd": 99.0, "ddp-fp16": 98.4}
    text = "\n".join(peers_section(runs, CALIBRATION, _convergence_rows(final), _projection(), GPU_COUNTS))
    assert "`powersgd` 5.0 s, `ddp-fp16` 8.0 s, `gradientflow` 12.0 s: `powersgd` reaches the target first" in text
    assert "highest `powersgd`" in text and "shortest `powersgd`" in text
    goals = [line for line in text.splitlines() if line.startswith("- Goal:")]
    assert "against `powersgd`: time to target 2.40x (NOT ahead), top-1 at the end -0.80 points" in goals[0]
    assert goals[0].endswith(": NOT met.")
    # 12.0 s against ddp's 9.5 s: not below it
    assert "median 1.26x" in goals[1] and goals[1].endswith(": NOT met.")
    # ahead on time but 0.8 points below at the end: not "at equal final top-1"
    runs = _comparison(csc=[90, 96, 98], powersgd=[90, 95, 96, 98])
    text = "\n".join(peers_section(runs, CALIBRATION, _convergence_rows(final), _projection(), GPU_COUNTS))
    goal = next(line for line in text.splitlines() if line.startswith("- Goal: `gradientflow` ahead"))
    assert "0.74x (ahead), top-1 at the end -0.80 points" in goal and goal.endswith(": NOT met.")


def test_without_convergence_rows_the_paragraph_says_where_to_look_and_claims_nothing() -> None:
    from report_words import peers_section

    runs = _comparison(csc=[90, 96, 98], powersgd=[90, 95, 96, 97])  # powersgd never reaches 98%
    text = "\n".join(peers_section(runs, {"profile": {}}, []))
    assert "no rows of its runs in `results/runs.csv`; run `make convergence`" in text
    assert "`powersgd` not reached in any seed" in text and "Local work per step: not measured" in text
    assert "| powersgd | rank 4 | not reached | not reached |" in text
    goal = next(line for line in text.splitlines() if line.startswith("- Goal: `gradientflow` ahead"))
    assert "`powersgd` not reached (ahead), top-1 at the end unknown" in goal and goal.endswith(": NOT met.")
    assert "The model at 512 GPUs: not projected here" in text and "`results/scaling.md`" in text
    assert "over the whole schedule: `results/convergence.md`" in text
    # below ddp's in the median, but seed 2 is as slow as ddp's seed 2 (2 + 5 x 1.5 = 9.5 s): not in every seed
    runs["gradientflow"][2] = _run("gradientflow", 2, [90, 95, 96, 97, 98])
    goal = next(line for line in peers_section(runs, {"profile": {}}, []) if "below `ddp`'s" in line)
    assert "median 0.68x" in goal and "seed 2: 1.00x = 0.50x x 1.67x x 1.20x" in goal and goal.endswith(": NOT met.")
    # a seed of gradientflow that never reaches the target: not below ddp's in every seed
    runs["gradientflow"][2] = _run("gradientflow", 2, [90, 96, 98])
    runs["gradientflow"][1] = _run("gradientflow", 1, [90, 96, 97])
    goal = next(line for line in peers_section(runs, {"profile": {}}, []) if "below `ddp`'s" in line)
    assert "seed 1: not reached" in goal and goal.endswith(": NOT met.")
    assert peers_section({"ddp": runs["ddp"], "gradientflow": runs["gradientflow"]}, {"profile": {}}) == []


# ---------------------------------------------------------------- the peers in every table
def test_the_peers_are_rows_of_every_table_of_the_report() -> None:
    from report_words import (
        clock_table,
        comparison_table,
        convergence_table,
        decomposition_table,
        model_check,
    )

    runs = _comparison(csc=[90, 96, 98], powersgd=[90, 95, 96, 97])
    every = ["ddp", "gradientflow", "gradientflow-paper", "ddp-fp16", "powersgd"]
    for table in (comparison_table(runs), clock_table(runs), decomposition_table(runs, "ddp"),
                  convergence_table(runs)[0]):
        assert [row.split("|")[1].strip() for row in table[2:]] == every
    assert "| powersgd | not reached | not reached |" in "\n".join(comparison_table(runs))
    assert "| powersgd | not reached | - | - | - | 0 of 3 |" in decomposition_table(runs, "ddp")
    rows = {row.split("|")[1].strip(): row.split("|")[2].strip() for row in convergence_table(runs)[0][2:]}
    assert rows == {"ddp": "1 (dense)", "gradientflow": "0.1", "gradientflow-paper": "0.1", "ddp-fp16": "1 (dense)",
                    "powersgd": "rank 4"}  # PowerSGD has no density: its rank
    # the model's check: the peers below the ladder, from their runs to the target, not in the goal
    network = {4: {"bandwidth_Bps": 1e8, "latency_s": 1e-4}}
    checks = {4: {"allreduce": {"step_s": 0.5, "sync_wait_s": 0.3}, "gradientflow": {"step_s": 0.3}}}
    peers = {4: {"ddp-fp16": {"step_s": 0.2}, "powersgd": {"step_s": 0.25}}}
    text = model_check(checks, CALIBRATION, network, False, None, 2, None, None, None, peers)
    shown = [row.split("|")[2].strip() for row in text if row.startswith("| 4 |")]
    assert shown == ["allreduce", "gradientflow", "ddp-fp16 (not in the goal)", "powersgd (not in the goal)"]
    assert "predictions are" in "\n".join(text) and " of 2 predictions" in "\n".join(text)


def test_the_convergence_study_shows_the_peers_and_what_our_additions_buy(tmp_path: Path) -> None:
    from gradientflow_repro.reproduction.convergence import write_study
    from gradientflow_repro.reproduction.runs import read_runs_csv

    never = None  # whole schedules: never stopped at a target
    runs = {"ddp": [_run("ddp", s, [90, 97, 99, 99.2], target=never) for s in range(2)],
            "gradientflow": [_run("gradientflow", s, [90, 96, 98.5, 99.0], target=never) for s in range(2)],
            "gradientflow-paper": [_run("gradientflow-paper", s, [90, 96, 89, 98.6], target=never) for s in range(2)],
            "powersgd": [_run("powersgd", s, [90, 95, 96, 97], target=never) for s in range(2)]}
    configs = {label: knobs.hydra_overrides(lineup.COMPARED[label]) for label in runs}
    machine = {"gpu": None, "cpu": "test CPU", "cpu_count": 2, "torch": "x", "git_commit": "c0ffee"}
    out = tmp_path / "convergence.md"
    write_study(out, runs, configs=configs, targets=[98.0, 98.5], world=4, experiment="digits_cpu", command="c",
                elapsed_s=60, kept=0, overrides=[], machine=machine, target=98.5)
    text = out.read_text()
    table = text[text.index("| configuration | density"):].split("\n\n")[0].splitlines()[2:]
    rows = {row.split("|")[1].strip(): [c.strip() for c in row.strip("|").split("|")] for row in table}
    assert list(rows) == ["ddp", "gradientflow", "gradientflow-paper", "powersgd"]
    assert rows["powersgd"][1:4] == ["rank 4", "not reached", "not reached"]
    assert "| powersgd | 90.0 | 95.0 | 96.0 | 97.0 |" in text
    assert "- `powersgd`: 98% reached in 0 of 2 seeds" in text
    assert ("Our additions (release cap, trust-ratio noise correction): `gradientflow` against `gradientflow-paper` "
            "(the paper's stack as published): epochs to 98% 3 against 4 (medians); top-1 at the end +0.40 points "
            "against the same seed's (from +0.40 to +0.40 over 2 seeds); falls of more than 5 points after the "
            "warm-up in 0 of 2 runs against 2 of 2.") in text
    written = read_runs_csv(tmp_path / "runs.csv")
    assert len(written) == 8 and {row["study"] for row in written} == {"convergence"}
    paper = [row for row in written if row["strategy"] == "gradientflow-paper"][0]
    assert paper["target_top1"] == 98.5 and paper["epochs_to_target"] == 4.0
    assert paper["largest_fall_after_warmup"] == 7.0
    assert paper["time_to_target_mlperf_s"] == pytest.approx(2 + 4 * 1.5)  # its fourth evaluation's clock
    assert [row["reached_target"] for row in written if row["strategy"] == "powersgd"] == [False, False]


# ---------------------------------------------------------------- results/runs.csv
def test_runs_csv_has_a_row_per_run_and_each_study_keeps_the_others_rows(tmp_path: Path) -> None:
    import pandas

    from gradientflow_repro.reproduction.runs import RUNS_CSV_COLUMNS, read_runs_csv, run_row, update_runs_csv

    path = tmp_path / "runs.csv"
    stopped = {"gradientflow": [_run("gradientflow", s, [90, 96, 98]) for s in range(2)],
               "powersgd": [_run("powersgd", s, [90, 95, 96, 97]) for s in range(2)]}  # never reaches 98%

    def rows(study: str, runs: dict, target: Optional[float] = 98.0) -> list[dict]:
        return [run_row(run, study=study, label=label, target=target) for label, items in runs.items() for run in items]

    update_runs_csv(path, "convergence", rows("convergence", {"ddp": [_run("ddp", 0, [90, 99], target=None)]}))
    update_runs_csv(path, "reproduce", rows("reproduce", stopped))
    with open(path, newline="") as handle:
        assert tuple(next(csv.reader(handle))) == RUNS_CSV_COLUMNS
    frame = pandas.read_csv(path)
    assert list(frame["study"]) == ["reproduce"] * 4 + ["convergence"]  # make convergence's row kept
    assert list(frame["strategy"]) == ["gradientflow", "gradientflow", "powersgd", "powersgd", "ddp"]
    assert list(frame["seed"]) == [0, 1, 0, 1, 0] and set(frame["world_size"]) == {4}
    first = frame.iloc[0]
    assert first["time_to_target_mlperf_s"] == pytest.approx(6.5)
    assert first["time_to_target_train_s"] == pytest.approx(3)
    assert first["epochs_to_target"] == 3 and first["sparse_epochs_to_target"] == 2 and first["final_top1"] == 98
    assert first["step_s"] == pytest.approx(0.1) and first["bytes_per_step"] == 1e6 and first["commit"] == "c0ffee"
    assert first["bytes_per_step_run_mean"] == 2e6 and first["compression"] == "0.1"
    never = frame.iloc[2]  # the configuration that never reached the target: a row, its time empty
    assert not never["reached_target"] and pandas.isna(never["time_to_target_mlperf_s"])
    assert pandas.isna(never["time_to_target_train_s"]) and pandas.isna(never["epochs_to_target"])
    assert never["final_top1"] == 97 and never["compression"] == "rank 4"
    convergence = frame.iloc[4]  # a whole schedule: its time to target from its first evaluation at it
    assert convergence["epochs_to_target"] == 2 and convergence["time_to_target_mlperf_s"] == pytest.approx(2 + 2 * 1.5)
    # a new reproduction replaces make reproduce's rows only; a new study only its own
    update_runs_csv(path, "reproduce", rows("reproduce", {"gradientflow": stopped["gradientflow"][:1]}))
    assert [(row["study"], row["strategy"]) for row in read_runs_csv(path)] == [
        ("reproduce", "gradientflow"), ("convergence", "ddp")]
    update_runs_csv(path, "convergence", [])
    assert [row["study"] for row in read_runs_csv(path)] == ["reproduce"]
    assert read_runs_csv(tmp_path / "absent.csv") == []


def test_a_report_written_from_a_reproduction_writes_its_rows_and_reads_the_studys(tmp_path: Path,
                                                                                   monkeypatch) -> None:
    """``report_from`` writes make reproduce's rows of runs.csv beside the report, keeps make
    convergence's, and hands those to the report (for top-1 at the end)."""
    import yaml

    from gradientflow_repro.reproduction import reproduce as rp
    from gradientflow_repro.reproduction.runs import read_runs_csv, run_row, update_runs_csv

    runs_dir, report = tmp_path / "runs", tmp_path / "out" / "REPORT.md"
    stopped = {"gradientflow": [_run("gradientflow", 0, [90, 96, 98])], "powersgd": [_run("powersgd", 0, [90, 97])]}
    for label, items in stopped.items():
        for run in items:
            run_dir = runs_dir / label / f"seed{run['config']['seed']}"
            run_dir.mkdir(parents=True)
            (run_dir / "summary.json").write_text(json.dumps(run["summary"]))
            (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in run["records"]))
            (run_dir / "config.yaml").write_text(yaml.safe_dump({**run["config"], "comm": run["comm"]}))
    (runs_dir / "reproduce.json").write_text(json.dumps({"rungs": list(stopped), "checks": {"4": {}}}))
    study = [run_row(_run("powersgd", 0, [90, 99], target=None), study="convergence", label="powersgd", target=98.0)]
    update_runs_csv(report.parent / "runs.csv", "convergence", study)
    written: dict = {}
    monkeypatch.setattr(rp, "write_report", lambda path, **facts: written.update(facts, path=path))
    rp.report_from(runs_dir, report)
    rows = read_runs_csv(report.parent / "runs.csv")
    assert [(row["study"], row["strategy"], row["reached_target"]) for row in rows] == [
        ("reproduce", "gradientflow", True), ("reproduce", "powersgd", False), ("convergence", "powersgd", True)]
    assert written["convergence_rows"] == rows[2:] and written["convergence_source"] == "`runs.csv` beside this report"
    assert list(written["runs"]) == ["gradientflow", "powersgd"]


# ---------------------------------------------------------------- both criteria from runs of the whole schedule
def _whole(label: str, seed: int, curve: list[float], step_s: float = 0.1, target: float = 98.0) -> dict:
    """A run of the whole ``curve`` (``target_top1=null``), measured against ``target`` as
    ``reproduce.report_from`` measures it (``runs.with_target``)."""
    from gradientflow_repro.reproduction.runs import with_target

    return with_target(_run(label, seed, curve, step_s, target=None), target)


def test_runs_of_the_whole_schedule_are_timed_to_the_target_at_their_first_evaluation_at_it() -> None:
    """MLPerf's criterion from runs that went on past the target: every table reads the first
    evaluation at or above it, as from runs that stopped there; without a target to measure them
    against, nothing is reached."""
    from report_words import clock_table, comparison_table, decomposition

    from gradientflow_repro.reproduction.runs import epochs_to_target, run_row

    curves = {"ddp": [90, 95, 98, 99, 97], "gradientflow": [90, 96, 97, 98.5, 99]}
    stopped = {label: [_run(label, s, curve, 0.2 if label == "ddp" else 0.05) for s in range(3)]
               for label, curve in curves.items()}
    whole = {label: [_whole(label, s, curve, 0.2 if label == "ddp" else 0.05) for s in range(3)]
             for label, curve in curves.items()}
    assert [epochs_to_target(r) for r in whole["gradientflow"]] == [4.0] * 3
    assert decomposition(whole, "ddp") == decomposition(stopped, "ddp") != {}
    assert clock_table(whole) == clock_table(stopped)
    # time and epochs to target as if stopped there; top-1 at the last evaluation is the schedule's end
    time_and_epochs = [[row.split("|")[2:4] for row in table[2:]] for table in (comparison_table(whole),
                                                                               comparison_table(stopped))]
    assert time_and_epochs[0] == time_and_epochs[1] and "not reached" not in str(time_and_epochs[0])
    assert comparison_table(whole)[2].split("|")[4].strip() == "97.00 [97.00-97.00]"
    row = run_row(whole["gradientflow"][0], study="reproduce", label="gradientflow", target=98.0)
    assert row["reached_target"] and row["epochs_to_target"] == 4.0 and row["epochs"] == 5
    assert row["time_to_target_mlperf_s"] == pytest.approx(2 + 4 * (10 * 0.05 + 0.5))
    unmeasured = _run("ddp", 0, curves["ddp"], target=None)  # no target given: none to reach
    assert epochs_to_target(unmeasured) is None


def test_the_paper_criterion_reads_each_runs_end_against_the_same_seeds_ddp() -> None:
    """The fixed schedule, per strategy: MLPerf's clock at the last evaluation, top-1 there, less
    the same seed's ddp run's (paired by seed, not by position), the largest fall after the warm-up
    (1 epoch); runs that stopped at the target say where the schedule is instead."""
    from report_words import _schedule_section, schedule_table

    runs = {"ddp": [_whole("ddp", s, [90, 95, 98, 97 + s], 0.2) for s in range(3)],  # ends 97, 98, 99
            "gradientflow": [_whole("gradientflow", 1, [90, 96, 98, 96], 0.05),  # seed 1 first
                             _whole("gradientflow", 0, [90, 96, 89, 98.5], 0.05),
                             _whole("gradientflow", 2, [90, 95, 97, 99.5], 0.05)]}
    table = schedule_table(runs, "ddp")
    rows = {row.split("|")[1].strip(): [c.strip() for c in row.strip("|").split("|")][1:] for row in table[2:]}
    assert "top-1 at the end - `ddp`'s, same seed (points)" in table[0]
    # 2 + 4 x (10 x 0.2 + 0.5) = 12 s; 2 + 4 x (10 x 0.05 + 0.5) = 6 s
    assert rows["ddp"] == ["12.0 [12.0-12.0]", "98.00 [97.00-99.00]", "- (the reference)", "0.0 [0.0-1.0]"]
    assert rows["gradientflow"] == ["6.0 [6.0-6.0]", "98.50 [96.00-99.50]",
                                    "seed 1 -2.00, seed 0 +1.50, seed 2 +0.50", "2.0 [0.0-7.0]"]
    text = "\n".join(_schedule_section(runs))
    assert text.startswith("## The paper's criterion: the fixed schedule") and "whole schedule (? epochs)" in text
    stopped = {"ddp": [_run("ddp", 0, [90, 98])], "gradientflow": [_run("gradientflow", 0, [90, 98])]}
    said = _schedule_section(stopped)
    assert len(said) == 3 and said[2].startswith("These runs stopped at the target") and "make convergence" in said[2]


def test_a_report_of_some_configurations_says_which_were_not_trained_and_what_it_cannot_check(tmp_path: Path) -> None:
    """patterns_cpu's default configurations (no `allreduce`, so no step-time runs): the report is
    whole, names the configurations not trained and `make convergence`, says in one line that the
    model is not checked, and has both criteria."""
    from gradientflow_repro.reproduction.report import write_report
    from gradientflow_repro.reproduction.reproduce import DEFAULT_RUNGS

    rungs = DEFAULT_RUNGS["patterns_cpu"]
    runs = {label: [_whole(label, s, [90, 95, 98, 98.5]) for s in range(2)] for label in rungs}
    network = {"emulated": True, "rate_mbit": 100.0, "bandwidth_Bps": 1e7, "latency_s": 1e-4, "why_not": None}
    machine = {"gpu": None, "cpu": "test CPU", "cpu_count": 2, "torch": "x", "git_commit": "c0ffee"}
    report = tmp_path / "REPORT.md"
    write_report(report, runs=runs, checks={4: {}}, calibration={**CALIBRATION, "compute_s": 0.05,
                                                                  "bytes_per_step": 1e6},
                 network=network, world=4, repeats=2, command="c", elapsed_s=60, experiment="patterns_cpu",
                 group="g", overrides=[], machine=machine, short_at_world=[], unshaped={}, allreduce_beside={})
    text = report.read_text()
    untrained = [label for label in lineup.COMPARED if label not in rungs]
    assert "allreduce" in untrained
    assert ("- Not trained here: " + ", ".join(f"`{label}`" for label in untrained)) in text
    assert "`make convergence` trains every configuration on loopback over the whole schedule" in text
    assert "MLPerf's, time to the target (98% top-1" in text and "schedule (? epochs, `target_top1=null`)" in text
    assert text.count("Not checked here: the scaling model is scaled to `allreduce`'s compute-only step") == 1
    assert "| world | strategy | measured step" not in text and "reproduce_step_split.png" not in text
    schedule = text[text.index("## The paper's criterion"):].split("\n\n")[1].splitlines()[2:]
    assert [row.split("|")[1].strip() for row in schedule] == list(rungs)
    mlperf = text[text.index("| strategy | time to target, MLPerf"):].split("\n\n")[0].splitlines()[2:]
    assert all("not reached" not in row for row in mlperf) and len(mlperf) == len(rungs)


def test_a_report_from_runs_of_the_whole_schedule_measures_them_against_the_reproductions_target(
        tmp_path: Path, monkeypatch) -> None:
    """``report_from`` gives each run the target the reproduction named (its runs had none to stop
    at): runs.csv and the report reach it at the first evaluation at or above it."""
    import yaml

    from gradientflow_repro.reproduction import reproduce as rp
    from gradientflow_repro.reproduction.runs import epochs_to_target, read_runs_csv

    runs_dir, report = tmp_path / "runs", tmp_path / "REPORT.md"
    for label, curve in (("ddp", [90, 95, 98.2, 99]), ("powersgd", [90, 95, 96, 97])):
        run = _run(label, 0, curve, target=None)
        run_dir = runs_dir / label / "seed0"
        run_dir.mkdir(parents=True)
        (run_dir / "summary.json").write_text(json.dumps(run["summary"]))
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in run["records"]))
        (run_dir / "config.yaml").write_text(yaml.safe_dump({**run["config"], "comm": run["comm"]}))
    (runs_dir / "reproduce.json").write_text(json.dumps({"rungs": ["ddp", "powersgd"], "checks": {"4": {}},
                                                         "target_top1": 98.0}))
    written: dict = {}
    monkeypatch.setattr(rp, "write_report", lambda path, **facts: written.update(facts, path=path))
    rp.report_from(runs_dir, report)
    rows = read_runs_csv(tmp_path / "runs.csv", "reproduce")
    assert [(row["strategy"], row["target_top1"], row["reached_target"], row["epochs_to_target"], row["epochs"])
            for row in rows] == [("ddp", 98.0, True, 3.0, 4.0), ("powersgd", 98.0, False, None, 4.0)]
    assert rows[0]["time_to_target_mlperf_s"] == pytest.approx(2 + 3 * 1.5)
    assert "target_top1" not in written  # each run's, not a fact of the report
    assert [epochs_to_target(run) for run in written["runs"]["ddp"]] == [3.0]


def _with_sends(run: dict, intervals: dict[str, float], masked: Optional[float]) -> dict:
    """``run`` whose sparse progress records carry CSC's send statistics, as the trainer logs them."""
    for record in run["records"]:
        if record["kind"] == "train" and record["epoch"] > 1.0:
            record["csc_send_interval_median"] = dict(intervals)
            if masked is not None:
                record["csc_masked_momentum_share"] = masked
    return run


def test_what_sparsification_did_is_a_table_of_the_sparse_runs_only() -> None:
    """Medians over the seeds of each layer's interval between sends, the slowest layer, the momentum
    erased by masking and the bytes after the warm-up; dense runs and runs without the records are not
    rows, and without any the section is absent."""
    import report_words as report

    curve = [50.0, 60.0, 70.0, 80.0]
    runs = {"ddp": [_run("ddp", seed, curve, target=None) for seed in (0, 1)],
            "gradientflow": [_with_sends(_run("gradientflow", seed, curve, target=None, sparse_mb=0.5),
                                         {"a.weight": 4.0 + seed, "b.weight": 10.0 + 2 * seed}, 0.1 + 0.1 * seed)
                             for seed in (0, 1, 2)],
            "gradientflow-mc": [_with_sends(_run("gradientflow-mc", 0, curve, target=None),
                                               {"a.weight": 2.0}, None)],
            "powersgd": [_run("powersgd", 0, curve, target=None)]}
    table = report.sparsification_table(runs)
    assert [line.split(" | ")[0] for line in table[2:]] == ["| gradientflow", "| gradientflow-mc"]
    assert table[2] == "| gradientflow | 5-12 | `b.weight` (12) | 20% | 0.500 |"
    assert table[3] == "| gradientflow-mc | 2-2 | `a.weight` (2) | - (none) | 1.000 |"
    assert report.sparsification_section({"ddp": runs["ddp"]}) == []


def test_the_final_top1_goal_allows_the_dense_seeds_spread_and_whole_runs_are_their_own_ends() -> None:
    """The paper's criterion as a goal: every seed of gradientflow within 0.3 points of the same seed's
    ddp, or within ddp's own spread over the seeds when larger; and the peers section reads top-1 at the
    end from whole-schedule runs themselves, not from `make convergence`."""
    from report_words import _final_gap_goal, peers_section

    ddp = [_whole("ddp", s, [90, 95, 98, 97 + 0.2 * s]) for s in range(3)]  # ends 97.0, 97.2, 97.4: spread 0.4
    close = [_whole("gradientflow", s, [90, 95, 98, 97 + 0.2 * s - 0.35]) for s in range(3)]
    far = [_whole("gradientflow", s, [90, 95, 98, 97 + 0.2 * s - (0.5 if s == 1 else 0.0)]) for s in range(3)]
    line = _final_gap_goal({"ddp": ddp, "gradientflow": close}, "ddp")[0]
    assert "spread (0.40 points)" in line and "seed 0 -0.35, seed 1 -0.35, seed 2 -0.35" in line
    assert line.endswith(": met.")
    assert _final_gap_goal({"ddp": ddp, "gradientflow": far}, "ddp")[0].endswith("seed 2 +0.00: NOT met.")
    runs = {"ddp": ddp, "gradientflow": close, "powersgd": [_whole("powersgd", s, [90, 95, 96, 96.5])
                                                            for s in range(3)]}
    text = "\n".join(peers_section(runs, CALIBRATION))
    assert "top-1 at the end of these runs (%)" in text and "make convergence` (%)" not in text
    assert "`gradientflow` 96.85%" in text and "`powersgd` 96.50%" in text

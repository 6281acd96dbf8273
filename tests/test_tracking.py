"""Tracking: the names under which the JSONL records reach wandb; a resumed run's metrics.jsonl is
one lineage (the abandoned segment's records moved beside it); a damaged line is skipped, not fatal."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest

from gradientflow_repro.config import LoggerConfig
from gradientflow_repro.reproduction.runs import at_target, evaluations, load_run
from gradientflow_repro.tracking import ABANDONED_NAME, Tracker, keep_one_lineage, lineage, read_records

from conftest import FAST, train


def test_wandb_metric_names_put_top1_against_wall_clock() -> None:
    from gradientflow_repro.tracking import wandb_keys

    assert wandb_keys({"kind": "eval", "top1": 91.5, "step": 40, "mlperf_s": 12.5, "train_s": 9.0,
                       "target_top1": None}) == {"val/top1": 91.5, "time/mlperf_s": 12.5, "time/train_s": 9.0}
    train = wandb_keys({"kind": "train", "loss": 0.3, "bytes_per_step": 1e6, "step": 41, "mlperf_s": 13.0})
    assert train == {"train/loss": 0.3, "comm/bytes_per_step": 1e6, "time/mlperf_s": 13.0}


# ---------------------------------------------------------------- one lineage after a resume
def _tracker(run_dir: Path) -> Tracker:
    return Tracker(run_dir, LoggerConfig(wandb=False), enabled=True, name="allreduce", group="test", config={})


class Segment:
    """One process of a run, logging as ``engine.Trainer`` does: a start record, a train record per
    step, evaluations, and a checkpoint record after each checkpoint."""

    def __init__(self, run_dir: Path, resumed_step: int) -> None:
        self.tracker = _tracker(run_dir).start(resumed_step)
        self.step = resumed_step
        self.log({"kind": "start", "resumed_from_step": resumed_step})

    def log(self, record: dict[str, Any]) -> None:
        self.tracker.log({**record, "step": self.step, "mlperf_s": 10.0 * self.step})

    def train_to(self, step: int) -> None:
        while self.step < step:
            self.step += 1
            self.log({"kind": "train", "loss": 1.0 / self.step, "epoch": self.step / 3})

    def evaluate(self, top1: float) -> None:
        self.log({"kind": "eval", "top1": top1, "target_top1": None, "epoch": self.step / 3})

    def checkpoint(self) -> None:
        self.tracker.checkpointed(self.step)

    def crash(self) -> None:  # what a killed process leaves: the file as written so far
        self.tracker._file.close()


def _finished_run(run_dir: Path, records: list[dict]) -> dict:
    """``load_run`` of the run: a summary of a whole-schedule run (no target of its own), so the time
    to target comes from its evaluations (``at_target``), as for a convergence run."""
    steps = max(r["step"] for r in records)
    (run_dir / "summary.json").write_text(json.dumps({"target_top1": None, "steps": steps, "epochs": steps / 3,
                                                      "strategy": "allreduce"}))
    return load_run(run_dir)


def test_a_resume_cuts_the_abandoned_segment_and_the_report_picks_the_lineage_evaluation(tmp_path: Path) -> None:
    """Checkpoint at step 3; trained on to step 7, evaluating at 6 above the target, then killed: that
    evaluation's state was lost. The resumed run (from 3) reaches the target only at step 9."""
    first = Segment(tmp_path, 0)
    first.train_to(3)
    first.evaluate(80.0)
    first.checkpoint()
    first.train_to(6)
    first.evaluate(95.0)  # above the target, in the segment that is lost
    first.train_to(7)
    first.crash()

    second = Segment(tmp_path, 3)
    second.train_to(6)
    second.evaluate(85.0)
    second.checkpoint()
    second.train_to(9)
    second.evaluate(92.0)
    second.checkpoint()
    second.tracker._close_metrics()

    records = read_records(tmp_path / "metrics.jsonl")
    trained = [r["step"] for r in records if r["kind"] == "train"]
    assert trained == list(range(1, 10)), "each step once, in order"
    assert [r["resumed_from_step"] for r in records if r["kind"] == "start"] == [0, 3]
    assert [(r["step"], r["top1"]) for r in records if r["kind"] == "eval"] == [(3, 80.0), (6, 85.0), (9, 92.0)]
    abandoned = read_records(tmp_path / ABANDONED_NAME)
    assert [(r["kind"], r["step"]) for r in abandoned] == [
        ("train", 4), ("train", 5), ("train", 6), ("eval", 6), ("train", 7)]
    assert all(r["abandoned_at_step"] == 3 for r in abandoned)
    run = _finished_run(tmp_path, records)
    assert evaluations(run) == [(1.0, 80.0), (2.0, 85.0), (3.0, 92.0)]
    reached = at_target(run, 90.0)
    assert reached is not None and (reached["step"], reached["top1"]) == (9, 92.0), reached


def test_an_evaluation_written_after_the_checkpoint_of_its_step_is_cut_with_its_segment(tmp_path: Path) -> None:
    """A stop at an epoch's end saves before it evaluates: the evaluation at step 3 follows the
    checkpoint of step 3, so a resume from that checkpoint evaluates again and the first one goes."""
    first = Segment(tmp_path, 0)
    first.train_to(3)
    first.checkpoint()
    first.evaluate(95.0)
    first.crash()
    second = Segment(tmp_path, 3)
    second.evaluate(91.0)
    second.train_to(4)
    second.checkpoint()
    second.tracker._close_metrics()

    records = read_records(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["top1"]) for r in records if r["kind"] == "eval"] == [(3, 91.0)]
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2, 3, 4]
    assert [(r["kind"], r["step"], r["top1"]) for r in read_records(tmp_path / ABANDONED_NAME)] == [("eval", 3, 95.0)]


def test_resumes_in_a_row_and_a_fresh_start_keep_one_lineage(tmp_path: Path) -> None:
    """Resumed twice from step 2 (the second time from the checkpoint the first resume wrote again),
    then restarted afresh in the same directory: each cut keeps one lineage and every record moved is
    in the side file; a resume with nothing to cut leaves metrics.jsonl as it was."""
    first = Segment(tmp_path, 0)
    first.train_to(2)
    first.checkpoint()
    first.crash()
    metrics = tmp_path / "metrics.jsonl"
    before = (metrics.stat().st_ino, metrics.read_bytes())
    assert keep_one_lineage(metrics, 2) == 0
    assert (metrics.stat().st_ino, metrics.read_bytes()) == before, "rewritten with nothing to cut"
    lost = Segment(tmp_path, 2)  # resumed, trained one step, killed before any checkpoint
    lost.train_to(3)
    lost.crash()
    second = Segment(tmp_path, 2)
    second.checkpoint()  # e.g. a run that had nothing left to train saves its step again
    second.train_to(4)
    second.crash()
    third = Segment(tmp_path, 2)  # from the checkpoint the second process wrote: its start record stays
    third.crash()
    records = read_records(metrics)
    assert [(r["kind"], r["step"]) for r in records] == [
        ("start", 0), ("train", 1), ("train", 2), ("checkpoint", 2), ("start", 2), ("checkpoint", 2), ("start", 2)]
    # no checkpoint to resume (resume=never moves an earlier run aside before this): nothing of the
    # old records is the new run's own
    fresh = Segment(tmp_path, 0)
    fresh.crash()
    assert [(r["kind"], r["step"]) for r in read_records(metrics)] == [("start", 0)]
    moved = [(r["kind"], r["step"], r["abandoned_at_step"]) for r in read_records(tmp_path / ABANDONED_NAME)]
    assert moved == [("start", 2, 2), ("train", 3, 2), ("train", 3, 2), ("train", 4, 2),
                     *[(r["kind"], r["step"], 0) for r in records]]


def test_a_file_written_before_checkpoint_records_is_cut_at_the_start_records() -> None:
    """Appended lineages, as runs logged before the cut existed (no checkpoint records; an epoch's
    evaluation came before its checkpoint): each start record cuts back to its step."""
    def record(kind: str, step: int, **extra: Any) -> dict:
        return {"kind": kind, "step": step, **extra}

    old = [record("start", 0, resumed_from_step=0), *[record("train", s) for s in (1, 2, 3)],
           record("eval", 3, top1=80.0), *[record("train", s) for s in (4, 5, 6)], record("eval", 6, top1=95.0),
           record("start", 3, resumed_from_step=3), *[record("train", s) for s in (4, 5, 6)],
           record("eval", 6, top1=85.0), record("train", 7)]
    kept, abandoned = lineage(old, 7)
    assert [(r["kind"], r["step"]) for r in kept] == [
        ("start", 0), ("train", 1), ("train", 2), ("train", 3), ("eval", 3), ("start", 3), ("train", 4),
        ("train", 5), ("train", 6), ("eval", 6), ("train", 7)]
    assert kept[-2]["top1"] == 85.0
    assert [(r["kind"], r["step"], r["abandoned_at_step"]) for r in abandoned] == [
        ("train", 4, 3), ("train", 5, 3), ("train", 6, 3), ("eval", 6, 3)]
    assert lineage(old, 0) == ([], [*abandoned, *({**r, "abandoned_at_step": 0} for r in kept)])  # afresh


# ---------------------------------------------------------------- damaged lines
def _lines(*records: Any) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def test_a_torn_line_and_a_nul_padded_tail_are_skipped_with_one_warning(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    good = [{"kind": "train", "step": s, "loss": 0.5} for s in (1, 2, 3)]
    path.write_bytes((_lines(good[0]) + '{"kind": "train", "step": 2, "lo\n' + _lines(good[1]) + "[1, 2]\n42\n"
                      + _lines(good[2])).encode() + b"\xff\xfe{\n" + b"\x00" * 4096)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert read_records(path) == good
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1, messages
    assert str(path) in messages[0] and "skipped 5 damaged line(s)" in messages[0], messages[0]
    assert "line(s) 2, 4, 5, 7, 8" in messages[0], messages[0]


def test_a_record_appended_after_nul_padding_is_read(tmp_path: Path) -> None:
    """Power lost: the file system zeroed the end of the file; the restarted run appended after the
    zeros. The record after them is read, the padding is named."""
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(_lines({"kind": "start", "step": 0}).encode() + b"\x00" * 100
                     + _lines({"kind": "start", "step": 4}).encode())
    with pytest.warns(UserWarning, match=r"skipped 1 damaged line\(s\).*line\(s\) 2;"):
        assert [r["step"] for r in read_records(path)] == [0, 4]


def test_a_resume_after_a_torn_write_leaves_a_clean_file_and_keeps_the_torn_text(tmp_path: Path) -> None:
    """Killed mid-write after its checkpoint: the resumed run's first record must not join the torn
    line, and once resumed, reading the run warns no more (the reports read a clean file)."""
    first = Segment(tmp_path, 0)
    first.train_to(2)
    first.checkpoint()
    first.crash()
    with open(tmp_path / "metrics.jsonl", "a") as handle:
        handle.write('{"kind": "train", "step": 3, "lo')  # torn: no end of line
    with pytest.warns(UserWarning, match="skipped 1 damaged line"):
        second = Segment(tmp_path, 2)
    second.train_to(3)
    second.crash()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        records = read_records(tmp_path / "metrics.jsonl")
    assert [(r["kind"], r["step"]) for r in records] == [
        ("start", 0), ("train", 1), ("train", 2), ("checkpoint", 2), ("start", 2), ("train", 3)]
    kept = read_records(tmp_path / ABANDONED_NAME)
    assert kept == [{"kind": "undecodable", "line": 5, "text": '{"kind": "train", "step": 3, "lo',
                     "abandoned_at_step": 2}]


def test_a_damaged_metrics_file_does_not_fail_the_report(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_bytes(
        (_lines({"kind": "eval", "step": 3, "epoch": 1.0, "top1": 91.0}) + '{"kind": "ev').encode() + b"\x00" * 512)
    (tmp_path / "summary.json").write_text(json.dumps({"target_top1": None, "steps": 3, "epochs": 1.0}))
    with pytest.warns(UserWarning, match="damaged line"):
        run = load_run(tmp_path)
    assert evaluations(run) == [(1.0, 91.0)] and at_target(run, 90.0)["step"] == 3


# ---------------------------------------------------------------- end to end
def test_a_run_killed_after_its_checkpoint_resumes_with_each_step_logged_once(
        tmp_path: Path, digits_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two gloo ranks, 11 steps per epoch: evaluation and checkpoint at step 11, rank 1 killed at the
    start of step 15 (rank 0 has logged steps 12 to 14), then the same command again: it resumes at
    step 11 and trains to 22. metrics.jsonl holds each step and each evaluation once."""
    run = tmp_path / "run"
    overrides = [*FAST, f"data.root={digits_root}", "global_batch_size=128", "epochs=2", "target_top1=null",
                 "optim.warmup_epochs=1", "eval_every_epochs=1", "checkpoint.every_epochs=1", "precise_bn_batches=0"]
    monkeypatch.setenv("GFR_ALLOW_FAULTS", "1")
    monkeypatch.setenv("GFR_INJECT_FAULT", "kill@forward:rank=1:step=14")
    with pytest.raises(RuntimeError, match="ranks failed"):
        train(2, overrides, run, timeout=60)
    logged = [r["step"] for r in read_records(run / "metrics.jsonl") if r["kind"] == "train"]
    assert logged[-1] > 11, f"killed before training past the checkpoint: {logged}"
    monkeypatch.delenv("GFR_INJECT_FAULT")
    resumed = train(2, overrides, run, timeout=60)
    assert "at step 11" in resumed, resumed[-2000:]
    records = read_records(run / "metrics.jsonl")
    assert [r["step"] for r in records if r["kind"] == "train"] == list(range(1, 23))
    assert [r["step"] for r in records if r["kind"] == "eval"] == [11, 22]
    assert [r["resumed_from_step"] for r in records if r["kind"] == "start"] == [0, 11]
    abandoned = read_records(run / ABANDONED_NAME)
    assert [r["step"] for r in abandoned if r["kind"] == "train"] == list(range(12, logged[-1] + 1))
    assert all(r["abandoned_at_step"] == 11 for r in abandoned)

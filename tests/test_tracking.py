"""Tracking: the names under which the JSONL records reach wandb."""

from __future__ import annotations


def test_wandb_metric_names_put_top1_against_wall_clock() -> None:
    from gradientflow_repro.tracking import wandb_keys

    assert wandb_keys({"kind": "eval", "top1": 91.5, "step": 40, "mlperf_s": 12.5, "train_s": 9.0,
                       "target_top1": None}) == {"val/top1": 91.5, "time/mlperf_s": 12.5, "time/train_s": 9.0}
    train = wandb_keys({"kind": "train", "loss": 0.3, "bytes_per_step": 1e6, "step": 41, "mlperf_s": 13.0})
    assert train == {"train/loss": 0.3, "comm/bytes_per_step": 1e6, "time/mlperf_s": 13.0}


def test_commit_is_marked_when_the_code_differs_from_it(tmp_path) -> None:
    import subprocess

    from gradientflow_repro.tracking import _git_commit

    def git(*args: str) -> str:
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path,
                              check=True, capture_output=True, text=True).stdout.strip()

    git("init", "-q")
    (tmp_path / "gradientflow_repro").mkdir()
    (tmp_path / "results").mkdir()
    (tmp_path / "gradientflow_repro" / "ring.py").write_text("a = 1\n")
    (tmp_path / "results" / "table.md").write_text("1\n")
    git("add", "-A")
    git("commit", "-qm", "first")
    head = git("rev-parse", "HEAD")
    assert _git_commit(tmp_path) == head
    (tmp_path / "results" / "table.md").write_text("2\n")  # new results: still the same code
    assert _git_commit(tmp_path) == head
    (tmp_path / "gradientflow_repro" / "ring.py").write_text("a = 2\n")
    assert _git_commit(tmp_path) == f"{head} (with uncommitted changes to the code)"
    assert _git_commit(tmp_path / "not-a-repo") is None

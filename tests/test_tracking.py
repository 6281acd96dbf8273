"""Tracking: the names under which the JSONL records reach wandb."""

from __future__ import annotations


def test_wandb_metric_names_put_top1_against_wall_clock() -> None:
    from gradientflow_repro.tracking import wandb_keys

    assert wandb_keys({"kind": "eval", "top1": 91.5, "step": 40, "mlperf_s": 12.5, "train_s": 9.0,
                       "target_top1": None}) == {"val/top1": 91.5, "time/mlperf_s": 12.5, "time/train_s": 9.0}
    train = wandb_keys({"kind": "train", "loss": 0.3, "bytes_per_step": 1e6, "step": 41, "mlperf_s": 13.0})
    assert train == {"train/loss": 0.3, "comm/bytes_per_step": 1e6, "time/mlperf_s": 13.0}

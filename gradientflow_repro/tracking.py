"""Results: a JSONL file under the run directory is the source of truth; wandb mirrors it.

Only rank 0 writes. Each record is flushed as it is written, so a killed run keeps everything up to
its last log line. wandb runs offline by default (no login, no network) in ``<run_dir>/wandb``; any
wandb failure turns it off with one warning and training goes on. The wandb run id is kept in the
checkpoint so a resumed run continues the same wandb run: the Tracker is the train state's Stateful
for it, so it starts (``start``) after a resume has set the id. Offline, each launch leaves one more
``offline-run-*`` piece of that id (wandb records no resume offline); docs/outputs.md gives the
upload that appends the pieces in order. ``run_summary`` builds the run's
``summary.json`` from its progress and the facts of the run.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Optional

from gradientflow_repro.config import LoggerConfig
from gradientflow_repro.provenance import environment_facts

# The wandb config key naming the compared configuration a run belongs to (its run name: the ladder's
# label under `make reproduce`, e.g. `ring+fp16` or `gradientflow@0.01`, else the strategy). The
# dashboards group seeds by it: `comm.strategy` alone cannot, several labels share one strategy.
WANDB_LABEL_KEY = "strategy_label"


class Tracker:
    """Writes nothing until ``start()``; before it, ``load_state_dict`` may set the wandb run id of
    the run being resumed (``state_dict`` is that id, for the checkpoint)."""

    def __init__(self, run_dir: Path, cfg: LoggerConfig, *, enabled: bool, name: str, group: str,
                 config: dict, run_id: Optional[str] = None) -> None:
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.wandb_run = None
        self.run_id = run_id
        self._file: Optional[Any] = None  # metrics.jsonl, open between start and finish
        self._wandb_args = (cfg, name, group, config)

    def state_dict(self) -> Optional[str]:
        return self.run_id

    def load_state_dict(self, run_id: Optional[str]) -> None:
        self.run_id = run_id

    def start(self) -> "Tracker":
        if not self.enabled:
            return self
        cfg, name, group, config = self._wandb_args
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._file = open(self.metrics_path, "a", buffering=1)
        if cfg.wandb and cfg.mode != "disabled":
            self._start_wandb(cfg, name, group, config, self.run_id)
        return self

    def _start_wandb(self, cfg: LoggerConfig, name: str, group: str, config: dict,
                     run_id: Optional[str]) -> None:
        try:
            import wandb

            os.environ.setdefault("WANDB_SILENT", "true")
            self.wandb_run = wandb.init(
                project=cfg.project, entity=cfg.entity, group=group, name=name,
                config={**config, WANDB_LABEL_KEY: name},
                dir=str(self.run_dir), mode=cfg.mode, id=run_id, resume="allow" if run_id else None,
                settings=wandb.Settings(init_timeout=60, console="off", x_disable_stats=True))
            self.run_id = self.wandb_run.id
            self.wandb_run.define_metric("time/mlperf_s")
            self.wandb_run.define_metric("val/*", step_metric="time/mlperf_s")
        except Exception as error:  # noqa: BLE001 - tracking must never stop training
            warnings.warn(f"wandb is off for this run: {type(error).__name__}: {error}")
            self.wandb_run = None

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps(record) + "\n")
        if self.wandb_run is not None:
            try:
                self.wandb_run.log(wandb_keys(record), step=record.get("step"))
            except Exception as error:  # noqa: BLE001
                warnings.warn(f"wandb is off for this run: {type(error).__name__}: {error}")
                self.wandb_run = None

    def finish(self, summary: dict[str, Any]) -> None:
        if not self._close_metrics():
            return
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        plot_top1(self.metrics_path, self.run_dir / "top1_vs_time.png", title=summary.get("name", ""))
        self._finish_wandb(summary={k: v for k, v in summary.items() if isinstance(v, (int, float, str))})

    def abandon(self) -> None:
        """The run failed: close what was opened (the JSONL keeps every record; the wandb run ends
        with a non-zero exit code). Nothing after ``finish``."""
        if self._close_metrics():
            self._finish_wandb(exit_code=1)

    def _close_metrics(self) -> bool:
        """Close metrics.jsonl; False if this rank never opened it or it is closed already."""
        if not self.enabled or self._file is None:
            return False
        self._file.close()
        self._file = None
        return True

    def _finish_wandb(self, summary: Optional[dict[str, Any]] = None, exit_code: Optional[int] = None) -> None:
        """End the wandb run (if any), with ``summary`` as its summary; a failure only warns."""
        if self.wandb_run is None:
            return
        try:
            if summary:
                self.wandb_run.summary.update(summary)
            self.wandb_run.finish(exit_code=exit_code)
        except Exception as error:  # noqa: BLE001
            warnings.warn(f"wandb could not finish: {error}")


def wandb_keys(record: dict[str, Any]) -> dict[str, float]:
    """A JSONL record as wandb metrics: clocks under ``time/``, evaluations under ``val/``,
    communication counts under ``comm/``, the rest under ``train/``."""
    prefix = "val" if record.get("kind") == "eval" else "train"
    metrics = {}
    for key, value in record.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or key == "step":
            continue
        if key in ("mlperf_s", "train_s", "eval_s", "startup_s", "init_s"):
            metrics[f"time/{key}"] = value
        elif key in ("bytes_per_step", "collectives_per_step", "sync_wait_s_per_step", "density",
                     "behind_slowest_s_per_step"):
            metrics[f"comm/{key}"] = value
        else:
            metrics[f"{prefix}/{key}"] = value
    return metrics


CLOCK_POLICY = ("mlperf_s: MLPerf's clock, from run_start (initialisation done, no data touched yet) to the "
                "end, never paused = startup_s (to the first step) + train_s (training steps) + eval_s "
                "(evaluations) + the rest (batch waits, logging, checkpoints); init_s: initialisation before "
                "run_start")


class Phases:
    """Seconds spent in each named phase of start-up, in order (for the run's start record, so a
    slow start-up says where its time went)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._since = time.perf_counter()

    def done(self, name: str) -> None:
        """The phase ``name`` ended now; the next one starts."""
        now = time.perf_counter()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - self._since
        self._since = now

    @property
    def total_s(self) -> float:
        return sum(self.seconds.values())


def run_summary(cfg: Any, progress: Any, *, world: Any, device: Any, steps_per_epoch: int,
                skipped_steps: int, stopped_by: str, exit_code: int, run_id: Optional[str]) -> dict[str, Any]:
    """``summary.json``: time to target on both clocks, top-1, images/s, communication per step,
    how the run ended, and what produced the numbers (command, environment, versions, hardware).
    ``progress``: the train state's TrainingProgress (step, clocks, top-1, reached_at, comm_totals)."""
    p, steps = progress, max(1, progress.step)
    reached = p.reached_at or {}
    train_s = p.train_s
    return {
        "name": f"{cfg.experiment}/{cfg.comm.strategy}", "experiment": cfg.experiment,
        "strategy": cfg.comm.strategy, "world_size": world.world_size,
        "device": str(device), "precision": cfg.precision.dtype,
        "global_batch_size": cfg.global_batch_size, "steps": p.step,
        "epochs": p.step / steps_per_epoch, "target_top1": cfg.target_top1,
        "reached_target": bool(p.reached_at),
        "time_to_target_mlperf_s": reached.get("mlperf_s"),
        "time_to_target_train_s": reached.get("train_s"),
        "final_top1": p.last_top1, "best_top1": p.best_top1,
        "mlperf_s": p.mlperf_s, "train_s": train_s,
        "images_per_s": p.step * cfg.global_batch_size / max(1e-9, train_s),
        "bytes_per_step": p.comm_totals["bytes"] / steps,
        "collectives_per_step": p.comm_totals["collectives"] / steps,
        "sync_wait_s_per_step": p.comm_totals["wait_s"] / steps,
        "skipped_steps": skipped_steps,
        "stopped_by": stopped_by or None, "exit_code": exit_code,
        "wandb_run_id": run_id,
        "clocks": p.clocks(), "clocks_at_target": p.reached_at or None,
        "clock_policy": CLOCK_POLICY,
        "command": f"{launcher_line(world)} -m gradientflow_repro.train " + " ".join(sys.argv[1:]),
        "environment": allowed_environment(), **environment_facts()}


def launcher_line(world: Any) -> str:
    """How this run was launched, as a command prefix (torchrun, srun or plain python)."""
    if world.source == "torchrun":
        return (f"torchrun --nnodes={world.world_size // world.local_world_size} "
                f"--nproc-per-node={world.local_world_size}")
    return {"slurm": f"srun --ntasks={world.world_size} python"}.get(world.source, "python")


def duration(seconds: float) -> str:
    """``1m05s``, ``42s``; ``?`` when unknown (for progress lines)."""
    if not math.isfinite(seconds):
        return "?"
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def read_records(path: Path) -> list[dict]:
    records = []
    with open(path) as handle:
        for line in handle:
            line = line.strip()
            if line:
                records.append(json.loads(line))
    return records


def plot_top1(metrics_path: Path, out: Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    evals = [r for r in read_records(metrics_path) if r.get("kind") == "eval"]
    figure, axes = plt.subplots(figsize=(6, 4))
    axes.plot([r["mlperf_s"] for r in evals], [r["top1"] for r in evals], marker="o")
    target = next((r.get("target_top1") for r in evals if r.get("target_top1")), None)
    if target:
        axes.axhline(target, linestyle="--", color="grey", label=f"target {target}%")
        axes.legend()
    axes.set_xlabel("wall-clock seconds (MLPerf clock: from start, evaluation included)")
    axes.set_ylabel("validation top-1 (%)")
    axes.set_title(title)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(out, dpi=100)
    plt.close(figure)


# Environment variables worth recording with a run; nothing else is written anywhere, and names
# that look like credentials are dropped even when they match (e.g. a hypothetical NCCL_..._KEY).
ENV_ALLOWED_PREFIXES = ("SLURM_JOB_", "SLURM_NTASKS", "SLURM_NNODES", "SLURM_RESTART_COUNT", "NCCL_",
                        "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "MASTER_ADDR", "MASTER_PORT",
                        "WORLD_SIZE", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT",
                        "GLOO_SOCKET_IFNAME", "WANDB_MODE", "DATA")
ENV_SECRET_WORDS = ("KEY", "TOKEN", "SECRET", "PASSWORD", "CREDENTIAL", "AUTH")


def allowed_environment(env: Optional[dict[str, str]] = None) -> dict[str, str]:
    env = dict(os.environ) if env is None else env
    return {name: value for name, value in sorted(env.items())
            if name.startswith(ENV_ALLOWED_PREFIXES) and not any(w in name for w in ENV_SECRET_WORDS)}


"""Results: a JSONL file under the run directory is the source of truth; wandb mirrors it.

Only rank 0 writes. Each record is flushed as it is written, so a killed run keeps everything up to
its last log line. wandb runs offline by default (no login, no network) in ``<run_dir>/wandb``; any
wandb failure turns it off with one warning and training goes on. The wandb run id is kept in the
checkpoint so a resumed run continues the same wandb run: the Tracker is the train state's Stateful
for it, so it starts (``start``) after a resume has set the id. Offline, each launch leaves one more
``offline-run-*`` piece of that id (wandb records no resume offline); docs/outputs.md gives the
upload that appends the pieces in order. ``run_summary`` builds the run's
``summary.json`` from its progress and the facts of the run.

A resumed run's metrics.jsonl is one lineage (``keep_one_lineage``), and ``read_records`` skips a
damaged line with one warning instead of failing every reader; the ``Tracker`` docstring says how.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Optional, Sequence

from gradientflow_repro.config import LoggerConfig
from gradientflow_repro.provenance import environment_facts
from gradientflow_repro.run_dir import write_text_atomically

# The wandb config key naming the compared configuration a run belongs to (its run name: the ladder's
# label under `make reproduce`, e.g. `ring+fp16` or `gradientflow@0.01`, else the strategy). The
# dashboards group seeds by it: `comm.strategy` alone cannot, several labels share one strategy.
WANDB_LABEL_KEY = "strategy_label"


ABANDONED_NAME = "metrics.abandoned.jsonl"  # beside metrics.jsonl: the records a resume cut off


class Tracker:
    """Writes nothing until ``start()``; before it, ``load_state_dict`` may set the wandb run id of
    the run being resumed (``state_dict`` is that id, for the checkpoint).

    One lineage: ``start(resumed_step)`` is told the step the process starts at (the checkpoint's
    step after a resume, 0 when nothing was resumed). Whatever metrics.jsonl holds beyond the
    checkpoint the run resumed from belongs to a segment whose state was lost (trained past it,
    then crashed or was killed): those records are cut from metrics.jsonl and appended to
    ``metrics.abandoned.jsonl`` beside it, each with ``abandoned_at_step`` (the step the run went
    back to), so every reader of metrics.jsonl sees each step once, as the surviving state reached
    it (a report never picks an evaluation whose state was lost), and nothing is silently deleted.
    Where the cut falls: each checkpoint is followed by a ``{"kind": "checkpoint", "step": S}``
    record (``checkpointed``), so the cut keeps exactly what was written before the checkpoint the
    run resumed from, whatever the order of evaluation and checkpoint at step S (files without such
    a record: every record up to the first one past step S; a fresh start at step 0: none).
    metrics.jsonl is rewritten whole (temporary file, fsync, rename), so a crash during the cut
    leaves the old file or the new one; damaged lines are dropped from it then, their text kept in
    the side file (``kind: "undecodable"``).

    wandb is not rewritten (it cannot be): it refuses a step lower than the last one it has, so the
    resumed run's records up to the step where the abandoned segment stopped are dropped there, and
    its history for those steps shows the abandoned segment's values; past them it follows the
    lineage. Offline, each launch's piece holds what that launch logged, and the upload that
    appends the pieces (docs/outputs.md) keeps, likewise, the first piece's values for steps it
    already has. metrics.jsonl, summary.json and the reports are the lineage; the wandb summary is
    the finished run's, hence the lineage's too."""

    def __init__(self, run_dir: Path, cfg: LoggerConfig, *, enabled: bool, name: str, group: str,
                 config: dict, run_id: Optional[str] = None) -> None:
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.wandb_run = None
        self.run_id = run_id
        self._file: Optional[Any] = None  # metrics.jsonl, open between start and finish
        self._checkpoint_logged: Optional[int] = None  # the step of the last checkpoint record written
        self._wandb_args = (cfg, name, group, config)

    def state_dict(self) -> Optional[str]:
        return self.run_id

    def load_state_dict(self, run_id: Optional[str]) -> None:
        self.run_id = run_id

    def start(self, resumed_step: Optional[int] = None) -> "Tracker":
        """Open metrics.jsonl for appending (and wandb). ``resumed_step``: the step this process
        starts at; the records of an abandoned segment are cut first (class docstring). None: no
        cut (for a caller that is no training run)."""
        if not self.enabled:
            return self
        cfg, name, group, config = self._wandb_args
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if resumed_step is not None:
            keep_one_lineage(self.metrics_path, resumed_step)
        _end_with_newline(self.metrics_path)  # a torn last line must not swallow the next record
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

    def checkpointed(self, step: int) -> None:
        """The checkpoint of ``step`` is complete: mark where a resume from it cuts metrics.jsonl.
        Written once per step by this process (saving a step again writes no checkpoint), to the
        JSONL only: it is bookkeeping, no metric for wandb."""
        if not self.enabled or self._file is None or step == self._checkpoint_logged:
            return
        self._checkpoint_logged = step
        self._file.write(json.dumps({"kind": "checkpoint", "step": step}) + "\n")

    def finish(self, summary: dict[str, Any]) -> None:
        if not self._close_metrics():
            return
        write_text_atomically(self.run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
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
    """The records of a metrics.jsonl, in order. A damaged line (torn by a crash mid-write, NUL bytes
    where a file system lost data after a power loss, anything that is no JSON object) is skipped
    with one warning naming the file, how many and which lines: one bad line must not fail a
    finished run or a report."""
    records, damaged, padded = _read_lines(path)
    _warn_damaged(path, damaged, padded)
    return [record for _, _, record in records]


# A run of NUL bytes: what a file system leaves where data it had not yet written was lost; treated
# as a line break, so a record appended after the padding is still read.
_NULS = re.compile(rb"\x00+")


def _read_lines(path: Path) -> tuple[list[tuple[int, bytes, dict]], list[tuple[int, bytes]], list[int]]:
    """(line number, raw text, record) of each JSON object in ``path``; (line number, raw text) of
    each piece that is none; the numbers of the lines that held NUL bytes."""
    records: list[tuple[int, bytes, dict]] = []
    damaged: list[tuple[int, bytes]] = []
    padded: list[int] = []
    with open(path, "rb") as handle:  # bytes: a torn multi-byte character must not stop the reading
        for number, line in enumerate(handle, start=1):
            pieces = _NULS.split(line)
            if len(pieces) > 1:
                padded.append(number)
            for piece in pieces:
                piece = piece.strip()
                if not piece:
                    continue
                try:
                    record = json.loads(piece.decode("utf-8"))
                except (UnicodeDecodeError, ValueError):  # JSONDecodeError is a ValueError
                    record = None
                if isinstance(record, dict):
                    records.append((number, piece, record))
                else:
                    damaged.append((number, piece))
    return records, damaged, padded


def _warn_damaged(path: Path, damaged: Sequence[tuple[int, bytes]], padded: Sequence[int]) -> None:
    """One warning for every damaged line of ``path`` (none when there is none)."""
    skipped = sorted({number for number, _ in damaged} | set(padded))
    if not skipped:
        return
    shown = ", ".join(str(number) for number in skipped[:10]) + (", ..." if len(skipped) > 10 else "")
    warnings.warn(f"{path}: skipped {len(skipped)} damaged line(s) (torn, NUL bytes, or no JSON object): "
                  f"line(s) {shown}; the other records are read", stacklevel=3)


def lineage(records: Sequence[dict], resumed_step: int) -> tuple[list[dict], list[dict]]:
    """``records`` (of a metrics.jsonl, in order) split into (kept, abandoned) for a run that
    resumes at ``resumed_step``. Replayed segment by segment: a start record with
    ``resumed_from_step`` R first cuts what precedes it back to R's checkpoint (files written before
    the cut existed hold several lineages), then the whole is cut back to ``resumed_step``; each
    abandoned record is returned with ``abandoned_at_step`` (the step its run went back to)."""
    kept: list[dict] = []
    abandoned: list[dict] = []

    def cut(step: int) -> None:
        at = _cut_index(kept, step)
        abandoned.extend({**record, "abandoned_at_step": step} for record in kept[at:])
        del kept[at:]

    for record in records:
        if record.get("kind") == "start" and kept:
            cut(int(record.get("resumed_from_step") or 0))
        kept.append(record)
    cut(resumed_step)
    return kept, abandoned


def _cut_index(records: Sequence[dict], step: int) -> int:
    """How many of ``records`` precede the checkpoint of ``step``: through its last checkpoint
    record (the checkpoint a resume of ``step`` loads: a later save of the same step replaced an
    earlier one); without one, up to the first record past ``step`` (written before checkpoint
    records existed, when an epoch's evaluation preceded its checkpoint); none for step 0 (a fresh
    start: no state carried over)."""
    for index in range(len(records) - 1, -1, -1):
        if records[index].get("kind") == "checkpoint" and records[index].get("step") == step:
            return index + 1
    if step <= 0:
        return 0
    return next((index for index, record in enumerate(records)
                 if isinstance(record.get("step"), (int, float)) and record["step"] > step), len(records))


def keep_one_lineage(metrics_path: Path, resumed_step: int) -> int:
    """Cut ``metrics_path`` to the lineage of a run resuming at ``resumed_step`` (``lineage``):
    the abandoned records, and the text of any damaged line, are appended to ``ABANDONED_NAME``
    beside it (first, and synced: a crash between the two writes duplicates there, loses nothing),
    then metrics.jsonl is replaced whole by what it keeps (temporary file, fsync, rename). Kept
    records keep their exact text. Returns how many records were moved; the file is left as it is
    when there is nothing to move or drop."""
    metrics_path = Path(metrics_path)
    if not metrics_path.is_file():
        return 0
    entries, damaged, padded = _read_lines(metrics_path)
    _warn_damaged(metrics_path, damaged, padded)
    kept, abandoned = lineage([record for _, _, record in entries], resumed_step)
    if not abandoned and not damaged and not padded:
        return 0
    side = [json.dumps(record) for record in abandoned]
    side += [json.dumps({"kind": "undecodable", "line": number, "text": raw.decode("utf-8", "replace"),
                         "abandoned_at_step": resumed_step}) for number, raw in damaged]
    if side:
        with open(metrics_path.with_name(ABANDONED_NAME), "a") as handle:
            handle.write("".join(line + "\n" for line in side))
            handle.flush()
            os.fsync(handle.fileno())
    temporary = metrics_path.with_name(metrics_path.name + ".tmp")
    kept_ids = {id(record) for record in kept}  # ``lineage`` keeps the records themselves, in order
    with open(temporary, "wb") as handle:
        handle.write(b"".join(raw + b"\n" for _, raw, record in entries if id(record) in kept_ids))
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, metrics_path)
    _sync_directory(metrics_path.parent)
    return len(abandoned)


def _sync_directory(directory: Path) -> None:
    """Make a rename in ``directory`` durable (where the platform allows opening a directory)."""
    try:
        descriptor = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


def _end_with_newline(path: Path) -> None:
    """If ``path`` ends in a torn line, end it, so that the next record appended starts a line."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    with open(path, "rb+") as handle:
        handle.seek(-1, os.SEEK_END)
        if handle.read(1) != b"\n":
            handle.write(b"\n")


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


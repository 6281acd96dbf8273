"""Every fault of the reliability suite injected into short real runs -> results/reliability.md

For each fault: what the harness did (exit code, the error it printed), how long after the fault
fired the job ended (time to detection), and whether anything was lost (the newest complete
checkpoint, and whether a resumed run finishes from it). The rows go to ``reliability.json`` beside the
table, which ``render/reproduction_study.py`` writes from them. Runs use torchrun with gloo on this
machine, the embedded digits data and a narrow model; faults are planned with ``GFR_INJECT_FAULT``
(``gradientflow_repro/faults.py``).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gradientflow_repro import REPO, render
from gradientflow_repro.checkpoint import complete_checkpoints
from gradientflow_repro.provenance import environment_facts
from gradientflow_repro.reproduction import fault_sequences

log = logging.getLogger(__name__)

KIND = "reproduction.reliability"  # the renderer of its document (render/reproduction_study.py)

BASE = ["+experiment=digits_cpu", "model.width=0.125", "logger=jsonl", "threads_per_rank=1",
        "global_batch_size=96", "epochs=3", "optim.warmup_epochs=1", "eval_every_epochs=1",
        "dist_timeout_s=30", "checkpoint.every_epochs=1"]

# (fault, world, GFR_INJECT_FAULT, extra overrides, preparation)
SCENARIOS = [
    ("rank 1 killed (SIGKILL) in the forward pass", 3, "kill@forward:rank=1:step=20", [], None),
    ("rank 1 killed entering communication (others inside the step's collectives)", 3,
     "kill@comm:rank=1:step=20", [], None),
    ("rank 1 killed while writing a checkpoint", 3, "kill@checkpoint:rank=1:step=30", [], None),
    ("rank 0 killed (it hosts nothing under torchrun: the agent holds the store)", 3,
     "kill@forward:rank=0:step=20", [], None),
    ("rank 1 frozen (SIGSTOP) entering communication: a hang, as a lost peer is under NCCL", 3,
     "freeze@comm:rank=1:step=20", ["watchdog_s=6"], None),
    ("rank 1 hung in the forward pass, outside any collective (alive: its heartbeat moves)", 3,
     "hang@forward:rank=1:step=20", [], None),
    ("one rank's parameters silently changed", 2, "perturb@params:rank=1:step=4",
     ["consistency_every_steps=2"], None),
    ("NaN loss on one rank (bf16)", 2, "nan@loss:rank=1:step=5", ["precision=bf16"], None),
    ("fp16 overflow on one rank, once", 2, "nan@loss:rank=0:step=3",
     ["precision=fp16", "device=cpu", "max_steps=12"], None),
    ("fp16 overflow on one rank, 3 steps in a row (limit 3)", 2,
     "nan@loss:rank=1:step=5,nan@loss:rank=1:step=6,nan@loss:rank=1:step=7",
     ["precision=fp16", "device=cpu", "max_nonfinite_steps=3"], None),
    ("newest checkpoint corrupted on disk, then resume", 2, "", ["max_steps=31"], "corrupt"),
    ("truncated JPEG in the training set", 2, "", ["max_steps=4"], "truncate"),
    ("run_dir is under a file", 2, "", [], "blocked_run_dir"),
    ("wandb unreachable (online mode, no server) and its directory unwritable", 2, "",
     ["logger=wandb", "logger.mode=online", "max_steps=6"], "broken_wandb"),
]


def torchrun(world: int, overrides: list[str], run_dir: Path, env: dict[str, str]) -> tuple[int, str, float]:
    """One training job through torchrun: (exit code, output, seconds)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
               "-m", "gradientflow_repro.train", f"run_dir={run_dir}", *overrides]
    started = time.time()
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", **env})
    return result.returncode, result.stdout + result.stderr, time.time() - started


def first_error(output: str, scratch: Path) -> str:
    """The first line of ``output`` that says what went wrong, paths shortened."""
    output = output.replace(str(REPO) + "/", "").replace(str(scratch), "$SCRATCH")
    for line in output.splitlines():
        if line.startswith("error:") or "lost rank" in line:
            return re.sub(r"\s+", " ", line.strip())[:220]
    warned = [line for line in output.splitlines() if "wandb is off" in line]
    return re.sub(r"\s+", " ", warned[0].strip())[:220] if warned else "-"


def prepare(kind: str | None, work: Path, digits: Path, run_dir: Path, env: dict[str, str]) -> tuple[Path, str]:
    """Returns (data root, note) after setting up the scenario's damage."""
    if kind == "truncate":
        root = work / "digits"
        shutil.copytree(digits, root)
        victim = sorted(sorted((root / "train").iterdir())[5].iterdir())[0]
        victim.write_bytes(victim.read_bytes()[:300])
        return root, f"{victim.relative_to(work)} cut to 300 bytes"
    if kind == "corrupt":
        code, output, _ = torchrun(2, [*BASE, f"data.root={digits}", "max_steps=31"], run_dir, {})
        newest = complete_checkpoints(run_dir)[-1]
        target = newest / "rank_00001.pt"
        target.write_bytes(target.read_bytes()[:1000])
        return digits, f"{target.relative_to(run_dir)} truncated after a run of 31 steps"
    if kind == "broken_wandb":
        run_dir.mkdir(parents=True)
        (run_dir / "wandb").write_text("a file")
        env.update(WANDB_API_KEY="not-a-real-key-0123456789abcdef0123456789abcdef0123", WANDB_BASE_URL="http://127.0.0.1:9")
        return digits, "wandb's directory is a file; its server address refuses connections"
    return digits, ""


def fault_report(out: Path, digits: Path = REPO / "data" / "digits",
                 command: str = "python scripts/fault_report.py") -> Path:
    """Run every scenario of ``SCENARIOS``; write the rows as data beside ``out`` (``.json``) and the
    table, rendered from it, to ``out``. Returns the data's path. FileNotFoundError without the data."""
    if not (digits / "train").is_dir():
        raise FileNotFoundError("data/digits is missing: run `make data` first")
    rows, started = [], time.time()
    for index, (fault, world, inject, extra, kind) in enumerate(SCENARIOS, 1):
        log.info(f"[{index}/{len(SCENARIOS)}] {fault}")
        with tempfile.TemporaryDirectory() as scratch:
            work = Path(scratch)
            run_dir = work / ("a_file/run" if kind == "blocked_run_dir" else "run")
            if kind == "blocked_run_dir":
                (work / "a_file").write_text("x")
            env = {"GFR_INJECT_FAULT": inject, "GFR_ALLOW_FAULTS": "1", "GFR_FAULT_LOG": str(work / "fired.jsonl")}
            root, note = prepare(kind, work, digits, run_dir, env)
            code, output, seconds = torchrun(world, [*BASE, f"data.root={root}", *extra], run_dir, env)
            ended = time.time()
            fired = work / "fired.jsonl"
            detection = (f"{ended - json.loads(fired.read_text().splitlines()[0])['time']:.1f} s"
                         if fired.exists() else "before training" if code == 2 or "cannot be decoded" in output
                         else "-")
            if "wandb" in fault:
                detection = "at start-up (one warning)"
            if kind == "corrupt":
                detection = "when resuming (SHA-256 mismatch)"
            if "config key" in output:
                detection = "before training"
            complete = complete_checkpoints(run_dir) if run_dir.is_dir() else []
            lost = "nothing written"
            if code == 0 and (run_dir / "summary.json").exists():
                summary = json.loads((run_dir / "summary.json").read_text())
                detection = "in the same step" if fired.exists() else detection
                lost = (f"nothing: the run finished ({summary['steps']} steps, "
                        f"{summary['skipped_steps']} skipped on every rank)")
            elif complete:
                resume_code, resume_output, _ = torchrun(world, [*BASE, f"data.root={root}", *extra], run_dir,
                                                         {"GFR_FAULT_LOG": ""})
                resumed = re.search(r"resumed from \S+ at step (\d+)", resume_output)
                lost = (f"nothing: newest complete checkpoint step {int(complete[-1].name.split('_')[1])}; "
                        f"a rerun resumed at step {resumed.group(1) if resumed else '?'} and "
                        f"{'finished' if resume_code == 0 else 'failed again (exit %d)' % resume_code}")
                if "resumed" not in resume_output and resume_code == 0:
                    lost = "nothing (no checkpoint needed)"
            if kind == "corrupt":
                skipped = re.search(r"(skipping|damaged)[^\n]*", output)
                lost = (f"the damaged checkpoint only ({note}); the run resumed from the previous one"
                        + (" after a warning naming the file" if skipped else ""))
            action = f"exit {code}; {first_error(output, work)}"
            rows.append((fault, world, action, detection, lost if kind != "truncate" else f"nothing: {note}, named "
                         "before training"))
            log.info(f"    -> {action[:150]} | {detection} | {rows[-1][4][:100]}")
    for index, scenario in enumerate(fault_sequences.SCENARIOS, len(SCENARIOS) + 1):
        log.info(f"[{index}/{len(SCENARIOS) + len(fault_sequences.SCENARIOS)}] {scenario.__name__}")
        with tempfile.TemporaryDirectory() as scratch:
            rows.append(scenario(Path(scratch), digits))
        log.info(f"    -> {rows[-1][2][:150]} | {rows[-1][3]} | {rows[-1][4][:100]}")
    log.info("[slurm] the templates' faults under the local Slurm")
    rows += fault_sequences.slurm_rows()
    facts = environment_facts()
    data = {"machine": {key: facts.get(key) for key in ("cpu", "cpu_count", "torch", "git_commit")},
            "command": command, "elapsed_s": time.time() - started,
            "rows": [{"fault": fault, "world": world, "action": action, "detection": detection, "lost": lost}
                     for fault, world, action, detection, lost in rows]}
    written = render.write_data(out.with_suffix(".json"), KIND, data)
    render.render_file(written, out)
    log.info(f"wrote {out}")
    return written

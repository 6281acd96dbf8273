"""The reproduction harness: everything behind ``scripts/`` (which are thin command lines over it).

    world.py           free_port, and spawn: a function in N gloo processes on this machine (tests, benchmarks)
    netemu.py          an emulated cluster: a namespace per node (ranks_per_node ranks on its loopback), a
                       bridge, one tbf-shaped uplink per node
    launch.py          start a job's ranks (in the emulated network or on loopback), stream rank 0, fail together
    netbench.py        the network as the ring and the backend see it (``python -m ...harness.netbench``)
    profile.py         a model's backward profile (measured, or from FLOPs) and local work per element
    runs.py            a finished run's summary and records, its steady step time
    progress.py        a long job's progress lines and its finished jobs on disk: an interrupted launch continues
    reproduce.py       the paper's comparison: calibrate, choose the link rate, train the ladder, report
    report.py          results/REPORT.md from a reproduction's runs
    scaling.py         the scaling model for any setup; by default the paper's, against its 410.2x and 2.5x
    cluster_check.py   the scaling model against the emulated two-level cluster's measurements
    bench_allreduce.py, bench_comm.py, bench_loader.py, bench_small.py, bench_cluster.py   ``make bench``
    fault_report.py    the fault-injection table of ``make reliability``
    wandb_report.py    a W&B report of one reproduction
    imagenet.py        check an ImageNet-layout folder, arrange a flat validation set

``code_version`` says which code a launch runs (kept runs must match it); ``compose`` is the
configuration a launch would run, composed in this process.
Importing the package imports nothing heavy; each module imports what it needs.
"""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence

if TYPE_CHECKING:
    from omegaconf import DictConfig

REPO = Path(__file__).resolve().parents[2]  # the checkout: configs/, results/ (an editable install)


def code_version() -> Optional[str]:
    """This checkout's commit and a digest of its uncommitted changes to tracked files (results and
    Markdown aside): what decides whether an earlier launch's runs may be kept. None where git
    cannot say (then nothing is kept)."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=30)
        diff = subprocess.run(["git", "diff", "HEAD", "--", ".", ":(exclude)results", ":(exclude)*.md"],
                              cwd=REPO, capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if head.returncode or diff.returncode:
        return None
    return head.stdout.strip() + (f"+{hashlib.sha256(diff.stdout).hexdigest()[:16]}" if diff.stdout else "")


def compose(overrides: Sequence[str]) -> "DictConfig":
    """The configuration ``gradientflow_repro.train`` runs with these Hydra ``overrides``, composed in
    this process from the checkout's ``configs/`` (no Hydra app, no run directory, nothing validated):
    how the benchmarks, profiles and checks read an experiment instead of restating it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from gradientflow_repro.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base=None):
        return hydra_compose(config_name="config", overrides=list(overrides))

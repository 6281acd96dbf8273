"""Which code, on which machine, produced a number.

Every result this project writes names what produced it, so that a reader can tell whether two
numbers are comparable and rerun either one:

- ``git_commit``: the checkout's HEAD, marked "(with uncommitted changes to the code)" when the code
  (the package, ``scripts/``, ``configs/``, ``slurm/``, the Makefile) differs from it. New results
  or notes do not mark it: they do not change what a run computes. A run's ``summary.json`` and
  every generated report carry it.
- ``code_version``: HEAD plus a digest of the uncommitted changes to tracked files (results and
  Markdown aside). Long jobs (``make reproduce``, the convergence study, the cluster benchmark)
  keep an earlier launch's runs only when it is unchanged: the digest tells two different
  uncommitted edits apart, which the marked commit cannot.
- ``environment_facts``: the commit above with the library versions and the hardware (CPU, GPU,
  core count): throughput and time to target depend on them as much as on the code.

Both commit readers ask git through one helper; where git cannot answer (no git, not a checkout,
a hung call) they return None rather than a guess.
"""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
from pathlib import Path
from typing import Any, Optional

from gradientflow_repro import REPO

# What decides what a run computes: an uncommitted change here marks the commit.
CODE_PATHS = ("gradientflow_repro", "scripts", "configs", "slurm", "Makefile")
# Left out of code_version's digest: written by the runs themselves, or prose.
NOT_CODE = (":(exclude)results", ":(exclude)*.md")
GIT_TIMEOUT_S = 60  # only a hung git reaches it


def _git(repo: Path, *args: str) -> Optional[bytes]:
    """``git args`` in ``repo``: its stdout, or None when git is missing, fails or hangs."""
    try:
        done = subprocess.run(["git", *args], cwd=repo, capture_output=True, timeout=GIT_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError):
        return None
    return None if done.returncode else done.stdout


def _head(repo: Path) -> Optional[str]:
    out = _git(repo, "rev-parse", "HEAD")
    if out is None:
        return None
    return out.decode().strip() or None


def git_commit(repo: Path = REPO) -> Optional[str]:
    """HEAD, marked "(with uncommitted changes to the code)" when a tracked file under
    ``CODE_PATHS`` differs from it: a number must name the code that produced it. None where git
    cannot say."""
    commit = _head(repo)
    if commit is None:
        return None
    changed = _git(repo, "status", "--porcelain", "--untracked-files=no", "--", *CODE_PATHS)
    if changed is None:
        return None
    return f"{commit} (with uncommitted changes to the code)" if changed.strip() else commit


def code_version(repo: Path = REPO) -> Optional[str]:
    """HEAD and a digest of the uncommitted changes to tracked files (results and Markdown aside):
    what decides whether an earlier launch's runs may be kept. None where git cannot say (then
    nothing is kept)."""
    commit = _head(repo)
    if commit is None:
        return None
    diff = _git(repo, "diff", "HEAD", "--", ".", *NOT_CODE)
    if diff is None:
        return None
    return commit + (f"+{hashlib.sha256(diff).hexdigest()[:16]}" if diff else "")


# key in a run's facts: the distributions that may provide it (DALI's name says its CUDA)
VERSIONED = {"torchvision": ("torchvision",), "dali": ("nvidia-dali-cuda130", "nvidia-dali-cuda120", "nvidia-dali"),
             "timm": ("timm",), "hydra": ("hydra-core",), "wandb": ("wandb",)}


def environment_facts() -> dict[str, Any]:
    """What produced a number: commit (``git_commit``), Python, torch and library versions, the
    platform, CPU model and core count, and the GPU (None without CUDA)."""
    import torch

    facts: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                             "platform": platform.platform(), "cpu": _cpu_model(),
                             "cpu_count": os.cpu_count()}
    for key, distributions in VERSIONED.items():  # read from the installed metadata: importing
        facts[key] = next((version for name in distributions  # torchvision and timm is slow
                           if (version := _installed_version(name)) is not None), None)
    facts["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    facts["git_commit"] = git_commit()
    return facts


def _installed_version(distribution: str) -> Optional[str]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"

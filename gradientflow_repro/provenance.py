"""Which code produced a number: the checkout's commit and its uncommitted changes."""

from __future__ import annotations

import hashlib
import subprocess
from typing import Optional

from gradientflow_repro import REPO


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

"""Provenance: the commit a number names, and the code version that decides whether runs are kept."""

from __future__ import annotations

import subprocess
from pathlib import Path

from gradientflow_repro.provenance import code_version, git_commit


def _checkout(tmp_path: Path):
    """A git checkout with one code file and one result, committed; returns its ``git``."""
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
    return git


def test_commit_is_marked_when_the_code_differs_from_it(tmp_path: Path) -> None:
    head = _checkout(tmp_path)("rev-parse", "HEAD")
    assert git_commit(tmp_path) == head
    (tmp_path / "results" / "table.md").write_text("2\n")  # new results: still the same code
    assert git_commit(tmp_path) == head
    (tmp_path / "gradientflow_repro" / "ring.py").write_text("a = 2\n")
    assert git_commit(tmp_path) == f"{head} (with uncommitted changes to the code)"
    assert git_commit(tmp_path / "not-a-repo") is None


def test_code_version_tells_different_uncommitted_edits_apart(tmp_path: Path) -> None:
    head = _checkout(tmp_path)("rev-parse", "HEAD")
    assert code_version(tmp_path) == head
    (tmp_path / "results" / "table.md").write_text("2\n")  # results and Markdown: not code
    assert code_version(tmp_path) == head
    (tmp_path / "gradientflow_repro" / "ring.py").write_text("a = 2\n")
    first_edit = code_version(tmp_path)
    assert first_edit.startswith(f"{head}+") and len(first_edit) == len(head) + 17
    (tmp_path / "gradientflow_repro" / "ring.py").write_text("a = 3\n")
    assert code_version(tmp_path) not in (head, first_edit)
    assert code_version(tmp_path / "not-a-repo") is None

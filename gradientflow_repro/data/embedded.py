"""What the embedded datasets (``digits.py``, ``patterns.py``) share: each is written once into a
temporary folder renamed into place at the end, so an interrupted build never leaves half a dataset
behind, and each has a command line that builds it and says what it wrote."""

from __future__ import annotations

import argparse
import logging
import shutil
from pathlib import Path
from typing import Callable

from gradientflow_repro import logs

log = logging.getLogger(__name__)


def write_atomically(root: str | Path, force: bool, write: Callable[[Path], None]) -> Path:
    """``root`` as ``write`` fills it (given a fresh temporary folder beside it), unless it holds
    ``train/`` and ``val/`` already (``force``: write it again, replacing it only once done)."""
    root = Path(root)
    if (root / "train").is_dir() and (root / "val").is_dir() and not force:
        return root
    tmp = root.with_name(root.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    write(tmp)
    if force:
        shutil.rmtree(root, ignore_errors=True)
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp.rename(root)
    return root


def command_line(description: str, name: str, build: Callable[[str, bool], Path], classes: int) -> None:
    """``python -m gradientflow_repro.data.<name> [root] [--force]``: build the dataset, say its counts."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("root", nargs="?", default=f"data/{name}")
    parser.add_argument("--force", action="store_true", help="rebuild even if present")
    args = parser.parse_args()
    logs.configure()  # a command's own lines: no run to name
    root = build(args.root, args.force)
    counts = {split: sum(1 for _ in (root / split).rglob("*.JPEG")) for split in ("train", "val")}
    log.info(f"{name} dataset at {root}: {counts['train']} train, {counts['val']} val images, {classes} classes")

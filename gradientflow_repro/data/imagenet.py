"""Checking an ImageNet-layout folder, and arranging a flat validation set into class folders.

``check`` logs the number of classes and images per split, the smallest and largest classes,
classes present in one split only, empty class folders, every file that cannot be decoded or that
the trainer's start-up check would refuse (by path), and notes for odd files that the loaders
handle (PNG content behind a .JPEG name, CMYK or grayscale JPEGs); it returns 1 if any problem was
found. ``arrange_val`` reads either the Kaggle CSV (``ImageId,PredictionString`` with the wnid
first) or lines of ``<file name> <wnid>`` and moves the images (same filesystem) into
``val/<wnid>/``; nothing is moved unless every listed file exists.
"""

from __future__ import annotations

import csv
import logging
import os
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

SUFFIXES = {".jpeg", ".jpg", ".png"}

log = logging.getLogger(__name__)


def inspect(path: str) -> tuple[str | None, str | None]:
    """(problem, note) for one file: a problem stops training (the trainer's own start-up check,
    ``file_problem``, or a failed decode); a note is something odd that the loaders handle (PNG
    content behind a JPEG name, CMYK or grayscale JPEGs: decoded to RGB)."""
    from PIL import Image

    from gradientflow_repro.data.listing import file_problem

    problem = file_problem(path)
    if problem:
        return problem, None
    try:
        with Image.open(path) as image:
            image.load()
            kind, mode = image.format, image.mode
    except Exception as error:  # noqa: BLE001 - every failure is reported by path
        return f"{type(error).__name__}: {error}", None
    notes = []
    if Path(path).suffix.lower() in (".jpeg", ".jpg") and kind != "JPEG":
        notes.append(f"{kind} content behind a JPEG name")
    if mode not in ("RGB",):
        notes.append(f"{mode} pixels")
    return None, (", ".join(notes) + " (decoded as RGB)") if notes else None


def check_split(split_dir: Path, workers: int) -> tuple[Counter, list[tuple[str, str]], list[tuple[str, str]]]:
    """Images per class of one split, and (path, problem) and (path, note) for its files."""
    counts: Counter = Counter()
    files: list[str] = []
    for class_dir in sorted(p for p in split_dir.iterdir() if p.is_dir()):
        images = [str(p) for p in class_dir.iterdir() if p.suffix.lower() in SUFFIXES]
        counts[class_dir.name] = len(images)
        files += images
    problems: list[tuple[str, str]] = []
    notes: list[tuple[str, str]] = []
    with ProcessPoolExecutor(max_workers=workers) as pool:
        for done, (path, (problem, note)) in enumerate(zip(files, pool.map(inspect, files, chunksize=256)), 1):
            if problem:
                problems.append((path, problem))
            if note:
                notes.append((path, note))
            if done % 20000 == 0 or done == len(files):
                log.info(f"  {split_dir.name}: checked {done}/{len(files)} files")
    return counts, problems, notes


def read_val_labels(label_file: Path) -> dict[str, str]:
    """Image file stem -> wnid, from the Kaggle CSV or ``<file name> <wnid>`` lines. A file name or
    class that is not a plain name (``../``, a path, ``.``) is refused naming its line: the class
    becomes a folder and the file is moved into it, so either could otherwise reach outside ``val/``."""
    labels: dict[str, str] = {}
    text = label_file.read_text()
    if text.startswith("ImageId"):
        rows = [(number, row["ImageId"], (row["PredictionString"] or "").split()[:1])
                for number, row in enumerate(csv.DictReader(text.splitlines()), 2)]
    else:
        rows = []
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip():
                parts = line.split()
                if len(parts) < 2:
                    raise SystemExit(f"{label_file}:{number}: expected '<file name> <wnid>'")
                rows.append((number, parts[0], parts[1:2]))
    for number, name, wnid in rows:
        for value in (name, *wnid):
            if not _plain_name(value):
                raise SystemExit(f"{label_file}:{number}: {value!r} is not a plain file or class name")
        if not wnid:
            raise SystemExit(f"{label_file}:{number}: no class for {name!r}")
        labels[Path(name).stem] = wnid[0]
    return labels


def _plain_name(value: str) -> bool:
    return bool(value) and value not in (".", "..") and "/" not in value and "\\" not in value and "\0" not in value


def arrange_val(val_dir: Path, label_file: Path) -> int:
    """Move the flat validation images of ``val_dir`` into class folders; returns 0."""
    labels = read_val_labels(label_file)
    flat = {p.stem: p for p in val_dir.iterdir() if p.is_file() and p.suffix.lower() in SUFFIXES}
    missing = sorted(set(labels) - set(flat))
    unlabelled = sorted(set(flat) - set(labels))
    if missing:
        raise SystemExit(f"{len(missing)} labelled images are not in {val_dir}, e.g. {missing[:3]}")
    for stem, wnid in labels.items():
        (val_dir / wnid).mkdir(exist_ok=True)
        os.replace(flat[stem], val_dir / wnid / flat[stem].name)
    log.info(f"moved {len(labels)} images into {len(set(labels.values()))} class folders under {val_dir}")
    if unlabelled:
        log.warning(f"{len(unlabelled)} images have no label and stay in place, e.g. {unlabelled[:3]}")
    return 0


def check(root: Path, workers: int = os.cpu_count() or 1) -> int:
    """Check ``root``/train and ``root``/val and log what was found (each problem a warning); returns
    1 on any problem."""
    failed = False
    classes = {}
    for split in ("train", "val"):
        split_dir = root / split
        if not split_dir.is_dir():
            log.warning(f"{split_dir}: missing")
            failed = True
            continue
        counts, problems, notes = check_split(split_dir, workers)
        classes[split] = set(counts)
        empty = sorted(c for c, n in counts.items() if n == 0)
        log.info(f"{split}: {len(counts)} classes, {sum(counts.values())} images")
        if counts:
            (small, n_small) = min(counts.items(), key=lambda kv: kv[1])
            (large, n_large) = max(counts.items(), key=lambda kv: kv[1])
            log.info(f"  smallest class {small} ({n_small}), largest {large} ({n_large})")
        for name in empty:
            log.warning(f"empty class folder: {split_dir / name}")
        for path, problem in problems:
            log.warning(f"unreadable: {path}: {problem}")
        for path, note in notes:
            log.info(f"  note: {path}: {note}")
        failed |= bool(empty or problems or not counts)
    if len(classes) == 2 and classes["train"] != classes["val"]:
        log.warning(f"classes differ between train and val: only in train "
                    f"{sorted(classes['train'] - classes['val'])[:5]}, "
                    f"only in val {sorted(classes['val'] - classes['train'])[:5]}")
        failed = True
    if failed:
        log.error("problems found")
    else:
        log.info("ok")
    return 1 if failed else 0

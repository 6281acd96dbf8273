"""An ImageNet-layout folder written once as webdataset shards that DALI reads natively, and the
manifest that describes them.

Why shards. The folder reader opens one file per image: at the paper's 1.35M images/s that is about
1.3M opens per second against a cluster's shared file system, and every rank lists the whole tree
at start-up. A shard is one tar file of ``samples_per_shard`` images (1,024 by default, about 110 MB
of ImageNet), read front to back: the opens drop by that factor and the reads become sequential.
Why webdataset (tar) rather than TFRecord or RecordIO: DALI reads it with its own reader
(``fn.readers.webdataset``, with a shuffle buffer and sharding over ranks) from index files made by
DALI's own ``wds2idx``; a tar is a plain POSIX archive that any tool lists and extracts; and the
images are stored as they are (no protobuf records to encode, no converter to trust).

Layout under ``OUT``::

    manifest.json                      what follows, written last (its presence marks a complete set)
    train/train-000000.tar             samples: <key>.jpg (the source file's bytes, unchanged) and
    train/train-000000.idx             <key>.cls (class index, 4-byte little-endian int32: DALI reads
    train/train-000000.json            it as INT32, nothing to parse); the key is the sample's
    val/val-000000.tar ...             8-digit position in its split; .idx: DALI's index; .json:
                                       the shard's record (below)

Each split's samples are shuffled once with a fixed seed before they are cut into shards, so a rank
that reads a contiguous run of shards sees every class. Writing is parallel (worker processes from
multiprocessing's ``spawn`` context: fresh interpreters, never forks of a threaded parent), resumable
and verified: a shard is written under a temporary name, re-read from disk (sha256 of the tar, DALI's
index made from it, every sample's bytes and label checked at the offsets the index gives) and only
then renamed into place, with a record of its size and checksums beside it. A rerun keeps a shard
whose record matches the plan (same files, labels, key range) and whose bytes still hash to the
record; it rewrites every other one and removes temporary files an interrupted run left behind.
The manifest holds the class-index mapping, counts per class, every shard's samples, sizes and
sha256 checksums, the seed, the source root and the format version.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import mmap
import multiprocessing
import os
import struct
import tarfile
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from gradientflow_repro.data.listing import DatasetError, list_image_folder

log = logging.getLogger(__name__)

FORMAT = "webdataset"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SPLITS = ("train", "val")
IMAGE, LABEL = "jpg", "cls"  # the components of a sample: DALI's ``ext``
SAMPLES_PER_SHARD = 1024
KEY_DIGITS = 8
PARTIAL = ".partial-"  # temporary names: ".<final name>.partial-<pid>"
CHUNK = 1 << 22


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True)
class ShardJob:
    """One shard to keep or write: ``entries`` are (key, source file, label) in stored order."""

    root: str  # the source split's folder: entries name files relative to it
    out: str  # the shards' split folder
    name: str  # e.g. train-000000
    split: str
    entries: tuple[tuple[str, str, int], ...]

    def plan(self) -> str:
        """What the shard must hold (keys, source files relative to the split, labels): a rerun
        keeps a shard only if the plan it was written for is this one."""
        digest = hashlib.sha256(f"v{FORMAT_VERSION}".encode())
        for key, path, label in self.entries:
            digest.update(f"{key}\0{path}\0{label}\n".encode())
        return digest.hexdigest()


def _member(name: str, data: bytes) -> tuple[tarfile.TarInfo, io.BytesIO]:
    info = tarfile.TarInfo(name)  # mtime 0, owner 0, mode 0644: the same bytes on every write
    info.size, info.mode = len(data), 0o644
    return info, io.BytesIO(data)


def _read_index(path: Path) -> list[dict[str, tuple[int, int, str]]]:
    """DALI's index (``v1.2 <samples>``, then per sample ``<ext> <offset> <size> <name>`` for each
    component) as one {ext: (offset, size, name)} per sample."""
    lines = path.read_text().splitlines()
    head = lines[0].split() if lines else []
    if len(head) != 2 or not head[0].startswith("v") or head[1] != str(len(lines) - 1):
        raise DatasetError(f"{path}: not a DALI webdataset index of {len(lines) - 1} samples (header {head})")
    samples = []
    for line in lines[1:]:
        parts = line.split()
        samples.append({parts[i]: (int(parts[i + 1]), int(parts[i + 2]), parts[i + 3])
                        for i in range(0, len(parts), 4)})
    return samples


def verify_written(tar_path: Path, index_path: Path,
                   expected: list[tuple[str, str, int, int]]) -> list[str]:
    """Problems of a written shard against ``expected`` (key, sha256 of the image bytes, their
    size, label) per sample, read back from disk through DALI's index of it; [] when it is right."""
    samples = _read_index(index_path)
    if len(samples) != len(expected):
        return [f"{tar_path}: index lists {len(samples)} samples, {len(expected)} were written"]
    problems = []
    with open(tar_path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
        for sample, (key, digest, size, label) in zip(samples, expected):
            if set(sample) != {IMAGE, LABEL}:
                problems.append(f"{tar_path}: sample {key} has components {sorted(sample)}")
                continue
            (at, length, name), (label_at, label_length, _) = sample[IMAGE], sample[LABEL]
            if name != f"{key}.{IMAGE}" or length != size or \
                    hashlib.sha256(data[at:at + length]).hexdigest() != digest:
                problems.append(f"{tar_path}: sample {key}: image bytes differ from the source file")
            if label_length != 4 or struct.unpack("<i", data[label_at:label_at + 4])[0] != label:
                problems.append(f"{tar_path}: sample {key}: label differs from {label}")
    return problems


def write_index(tar_path: Path, index_path: Path) -> None:
    """DALI's index of ``tar_path``, made by DALI's own tool (``wds2idx``, installed with DALI)."""
    try:
        from wds2idx import IndexCreator
    except ImportError as error:
        raise DatasetError("DALI's wds2idx (installed with nvidia-dali) is needed to index the shards") from error
    with IndexCreator(str(tar_path), str(index_path), verbose=False) as creator:
        creator.create_index()


def _replace(tmp: Path, final: Path) -> None:
    with open(tmp, "rb+") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, final)


def _record_matches(job: ShardJob, out: Path) -> Optional[dict]:
    """The shard's record if the files on disk are the ones it describes (sizes and sha256), for
    the same plan; None if the shard must be written."""
    try:
        record = json.loads((out / f"{job.name}.json").read_text())
    except (OSError, ValueError):
        return None
    tar_path, index_path = out / f"{job.name}.tar", out / f"{job.name}.idx"
    try:
        if record.get("plan") != job.plan() or tar_path.stat().st_size != record["bytes"] or \
                index_path.stat().st_size != record["index_bytes"]:
            return None
    except (OSError, KeyError):
        return None
    if sha256_of(tar_path) != record["sha256"] or sha256_of(index_path) != record["index_sha256"]:
        return None
    return record


def build_shard(job: ShardJob) -> tuple[dict, bool]:
    """Keep the shard if it is already written and verified, else write it: (its record, whether it
    was written). Runs in a worker process."""
    out = Path(job.out)
    kept = _record_matches(job, out)
    if kept is not None:
        return kept, False
    tmp_tar, tmp_index = (out / f".{job.name}{suffix}{PARTIAL}{os.getpid()}" for suffix in (".tar", ".idx"))
    expected = []
    try:
        with tarfile.open(tmp_tar, "w", format=tarfile.USTAR_FORMAT) as tar:
            for key, path, label in job.entries:
                try:
                    image = (Path(job.root) / path).read_bytes()
                except OSError as error:
                    raise DatasetError(f"{Path(job.root) / path}: {error.strerror}") from None
                expected.append((key, hashlib.sha256(image).hexdigest(), len(image), label))
                tar.addfile(*_member(f"{key}.{IMAGE}", image))
                tar.addfile(*_member(f"{key}.{LABEL}", struct.pack("<i", label)))
        write_index(tmp_tar, tmp_index)
        problems = verify_written(tmp_tar, tmp_index, expected)
        if problems:
            raise DatasetError("\n".join(problems))
        record = {"tar": f"{job.split}/{job.name}.tar", "index": f"{job.split}/{job.name}.idx",
                  "samples": len(job.entries), "first_key": job.entries[0][0],
                  "bytes": tmp_tar.stat().st_size, "sha256": sha256_of(tmp_tar),
                  "index_bytes": tmp_index.stat().st_size, "index_sha256": sha256_of(tmp_index),
                  "plan": job.plan()}
        _replace(tmp_index, out / f"{job.name}.idx")
        _replace(tmp_tar, out / f"{job.name}.tar")
        write_json_atomically(out / f"{job.name}.json", record)
        return record, True
    finally:
        for tmp in (tmp_tar, tmp_index):
            tmp.unlink(missing_ok=True)


def write_json_atomically(path: Path, value: object) -> None:
    tmp = path.with_name(f".{path.name}{PARTIAL}{os.getpid()}")
    tmp.write_text(json.dumps(value, indent=1) + "\n")
    _replace(tmp, path)


def plan_split(root: Path, out: Path, split: str, classes: Optional[list[str]], seed: int,
               samples_per_shard: int) -> tuple[list[str], Counter, list[ShardJob]]:
    """(classes, images per class, shard jobs) of ``root/split``, shuffled with ``seed``."""
    listing = list_image_folder(root / split, classes)
    order = np.random.default_rng([seed, SPLITS.index(split)]).permutation(len(listing))
    base = root / split
    entries = [(f"{position:0{KEY_DIGITS}d}", str(Path(listing.files[i]).relative_to(base)), listing.labels[i])
               for position, i in enumerate(order.tolist())]
    jobs = [ShardJob(str(base), str(out / split), f"{split}-{number:06d}", split,
                     tuple(entries[start:start + samples_per_shard]))
            for number, start in enumerate(range(0, len(entries), samples_per_shard))]
    counts = Counter({name: 0 for name in listing.classes})
    counts.update(listing.classes[label] for label in listing.labels)
    return listing.classes, counts, jobs


def _remove_leftovers(folder: Path, split: str, jobs: list[ShardJob]) -> int:
    """Removes the temporary files of an interrupted run, and shards the plan does not have (left by
    a run with another shard size); returns how many files it removed."""
    planned, removed = {job.name for job in jobs}, 0
    for path in folder.iterdir():
        stale = path.suffix in (".tar", ".idx", ".json") and path.stem.startswith(f"{split}-") and \
            path.stem not in planned
        if PARTIAL in path.name or stale:
            path.unlink()
            removed += 1
    return removed


def write_shards(root: Path, out: Path, *, samples_per_shard: int = SAMPLES_PER_SHARD, seed: int = 0,
                 workers: int = 1) -> dict:
    """Write (or complete) the shards of the ImageNet-layout folder ``root`` under ``out`` and its
    manifest; returns the manifest. ``workers`` > 1 writes shards in that many spawned processes.
    Shards already written and verified for this plan are kept (the module's docstring)."""
    if samples_per_shard < 1:
        raise DatasetError(f"samples per shard must be positive, not {samples_per_shard}")
    started, classes = time.monotonic(), None
    manifest: dict = {"format": FORMAT, "format_version": FORMAT_VERSION, "source_root": str(root),
                      "seed": seed, "samples_per_shard": samples_per_shard,
                      "components": {IMAGE: "the source image file's bytes, unchanged",
                                     LABEL: "class index (position in 'classes'), int32 little-endian"},
                      "classes": [], "splits": {}}
    (out / MANIFEST).unlink(missing_ok=True)  # a manifest stands for a complete set only
    for split in SPLITS:
        classes, counts, jobs = plan_split(root, out, split, classes, seed, samples_per_shard)
        (out / split).mkdir(parents=True, exist_ok=True)
        removed = _remove_leftovers(out / split, split, jobs)
        records, written = _run_jobs(jobs, workers, split)
        log.info(f"{split}: {len(jobs)} shards ({written} written, {len(jobs) - written} kept; {removed} "
                 f"leftover files removed)")
        manifest["splits"][split] = {"samples": sum(counts.values()),
                                     "bytes": sum(r["bytes"] + r["index_bytes"] for r in records),
                                     "counts_per_class": dict(counts), "shards": records}
    manifest["classes"] = classes
    write_json_atomically(out / MANIFEST, manifest)
    log.info(f"wrote {out / MANIFEST} in {time.monotonic() - started:.1f} s")
    return manifest


def _run_jobs(jobs: list[ShardJob], workers: int, split: str) -> tuple[list[dict], int]:
    records: list[Optional[dict]] = [None] * len(jobs)
    written = 0

    def note(done: int, result: tuple[dict, bool]) -> None:
        nonlocal written
        written += result[1]
        if done % 50 == 0 or done == len(jobs):
            log.info(f"  {split}: {done}/{len(jobs)} shards")

    if workers <= 1:
        for number, job in enumerate(jobs):
            result = build_shard(job)
            records[number] = result[0]
            note(number + 1, result)
        return records, written  # type: ignore[return-value]
    # spawn: fresh interpreters, never a fork of this (possibly threaded) process
    with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        for number, result in enumerate(pool.map(build_shard, jobs)):
            records[number] = result[0]
            note(number + 1, result)
    return records, written  # type: ignore[return-value]


# ------------------------------------------------------------------ reading the manifest back
@dataclass(frozen=True)
class SplitShards:
    samples: int
    tars: list[str]
    indexes: list[str]


@dataclass(frozen=True)
class Manifest:
    root: Path
    classes: list[str]
    train: SplitShards
    val: SplitShards


def shard_files(manifest: dict) -> list[tuple[str, int, str]]:
    """(path relative to the manifest's folder, bytes, sha256) of every file the manifest lists."""
    return [(record[kind], record[size], record[digest])
            for split in manifest["splits"].values() for record in split["shards"]
            for kind, size, digest in (("tar", "bytes", "sha256"), ("index", "index_bytes", "index_sha256"))]


def read_manifest(path: Path) -> dict:
    """The manifest at ``path``, its format checked; DatasetError naming the file otherwise."""
    if not path.is_file():
        raise DatasetError(f"{path}: no shard manifest (data.root must be the folder of the manifest.json that "
                           f"scripts/prepare_imagenet.py ROOT --shards OUT writes)")
    try:
        manifest = json.loads(path.read_text())
    except ValueError as error:
        raise DatasetError(f"{path}: not JSON ({error})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or \
            manifest.get("format_version") != FORMAT_VERSION:
        raise DatasetError(f"{path}: not a {FORMAT} shard manifest of format version {FORMAT_VERSION}")
    for split in SPLITS:
        shards = manifest.get("splits", {}).get(split, {}).get("shards")
        if not shards:
            raise DatasetError(f"{path}: no '{split}' shards listed")
        if sum(record["samples"] for record in shards) != manifest["splits"][split]["samples"]:
            raise DatasetError(f"{path}: the '{split}' shards' samples do not add up to its count")
    return manifest


def load_manifest(root: Path) -> Manifest:
    """The manifest under ``root``, read once, with every shard file it lists present at its
    recorded size (a stat per file: DALI opens every one anyway); DatasetError naming each file
    that is missing or of another size, before any pipeline is built."""
    manifest = read_manifest(root / MANIFEST)
    problems = []
    for relative, size, _ in shard_files(manifest):
        path = root / relative
        try:
            found = path.stat().st_size
        except OSError:
            problems.append(f"  {path}: missing")
            continue
        if found != size:
            problems.append(f"  {path}: {found} bytes, the manifest says {size}")
    if problems:
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise DatasetError(f"{len(problems)} shard file(s) do not match {root / MANIFEST}:\n"
                           + "\n".join(problems[:20]) + more + "\n(stage them again: python -m "
                           "gradientflow_repro.data.stage, or rewrite: scripts/prepare_imagenet.py --shards)")

    def split(name: str) -> SplitShards:
        shards = manifest["splits"][name]["shards"]
        return SplitShards(manifest["splits"][name]["samples"], [str(root / r["tar"]) for r in shards],
                           [str(root / r["index"]) for r in shards])

    return Manifest(root, list(manifest["classes"]), split("train"), split("val"))


def _check_file(item: tuple[str, int, str]) -> Optional[str]:
    path, size, digest = item
    try:
        if os.path.getsize(path) != size:
            return f"{path}: {os.path.getsize(path)} bytes, the manifest says {size}"
        return None if sha256_of(Path(path)) == digest else f"{path}: sha256 differs from the manifest"
    except OSError as error:
        return f"{path}: {error.strerror}"


def verify_shards(root: Path, workers: int = 1) -> list[str]:
    """Every file the manifest under ``root`` lists, re-read and checked (size, sha256): the
    problems found, [] when all match."""
    listed = shard_files(read_manifest(root / MANIFEST))
    items = [(str(root / relative), size, digest) for relative, size, digest in listed]
    if workers <= 1:
        return [problem for problem in map(_check_file, items) if problem]
    with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        return [problem for problem in pool.map(_check_file, items, chunksize=4) if problem]

"""Copy a shard set to node-local storage before the ranks start (one task per node):

    python -m gradientflow_repro.data.stage --manifest SRC/manifest.json --to DST [--workers N] [--verify]

Every file the manifest lists (shards and DALI's index files) is copied to the same relative path
under ``DST``, then the manifest itself, last: a manifest in ``DST`` means the set there is whole, and
training reads it with ``data.root=DST``. Idempotent: a file already in ``DST`` at the manifest's size
is kept (with ``--verify``, only if its sha256 matches too), so a rerun after an interruption copies
what is missing and a rerun on a staged node copies nothing. Atomic: each file is written under a
temporary name and renamed into place. With ``--verify`` every copied file is hashed as it is copied
and compared with the manifest. Logs progress, then the bytes copied, the time and the bandwidth;
exits 1 with a message naming the file on any error (a source missing or of the wrong size, a
checksum that differs, a full disk). Why node-local: the shards are read at the training's pace by
every rank of the node, from page cache or a local disk rather than a shared file system.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import shutil
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional, Sequence

from gradientflow_repro import logs
from gradientflow_repro.data.shards import CHUNK, MANIFEST, PARTIAL, read_manifest, sha256_of, shard_files

log = logging.getLogger(__name__)


class StageError(Exception):
    pass


def _copy_hashing(source: Path, target: Path) -> str:
    digest = hashlib.sha256()
    with open(source, "rb") as read, open(target, "wb") as write:
        while block := read.read(CHUNK):
            digest.update(block)
            write.write(block)
    return digest.hexdigest()


def stage_file(source: Path, target: Path, size: int, digest: str, verify: bool) -> int:
    """Bytes copied (0 when ``target`` is already right); StageError naming the file otherwise."""
    if target.is_file() and target.stat().st_size == size and (not verify or sha256_of(target) == digest):
        return 0
    try:
        found = source.stat().st_size
    except OSError as error:
        raise StageError(f"{source}: {error.strerror}") from None
    if found != size:
        raise StageError(f"{source}: {found} bytes, the manifest says {size}")
    tmp = target.with_name(f".{target.name}{PARTIAL}{os.getpid()}-{threading.get_ident()}")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        if verify:
            if _copy_hashing(source, tmp) != digest:
                raise StageError(f"{source}: sha256 differs from the manifest")
        else:
            shutil.copyfile(source, tmp)
        if tmp.stat().st_size != size:
            raise StageError(f"{tmp}: {tmp.stat().st_size} bytes after the copy, the manifest says {size}")
        os.replace(tmp, target)
    except OSError as error:
        raise StageError(f"copying {source} to {target}: {error.strerror or error}") from None
    finally:
        tmp.unlink(missing_ok=True)
    return size


def stage(manifest_path: Path, to: Path, workers: int = 8, verify: bool = False,
          progress_s: float = 5.0) -> dict:
    """Stage the set ``manifest_path`` describes to ``to``; returns what was done (files, bytes
    copied and kept, seconds, bytes per second)."""
    started = time.monotonic()
    source_root = manifest_path.parent
    try:
        manifest = read_manifest(manifest_path)
    except ValueError as error:  # DatasetError: a missing or malformed manifest
        raise StageError(str(error)) from None
    files = shard_files(manifest)
    total = sum(size for _, size, _ in files)
    staged_manifest = to / MANIFEST
    if staged_manifest.is_file() and sha256_of(staged_manifest) != sha256_of(manifest_path):
        staged_manifest.unlink()  # another set's: until this one is whole, no manifest says it is
    done, copied, lock, last = 0, 0, threading.Lock(), [started]

    def one(item: tuple[str, int, str]) -> None:
        nonlocal done, copied
        relative, size, digest = item
        moved = stage_file(source_root / relative, to / relative, size, digest, verify)
        with lock:
            done, copied = done + 1, copied + moved
            now = time.monotonic()
            if now - last[0] >= progress_s or done == len(files):
                last[0] = now
                rate = copied / max(now - started, 1e-9)
                log.info(f"{done}/{len(files)} files, {copied / 1e9:.2f} GB copied of {total / 1e9:.2f} GB, "
                         f"{rate / 1e9:.2f} GB/s")

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:  # threads: copying waits on I/O
        for _ in pool.map(one, files):
            pass
    stage_file(manifest_path, staged_manifest, manifest_path.stat().st_size,
               sha256_of(manifest_path), verify=True)  # last: its presence marks a whole set
    elapsed = time.monotonic() - started
    return {"files": len(files), "bytes": total, "copied_bytes": copied, "kept_bytes": total - copied,
            "seconds": elapsed, "bytes_per_s": copied / max(elapsed, 1e-9)}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gradientflow_repro.data.stage", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--manifest", type=Path, required=True, help="SRC/manifest.json of the shard set")
    parser.add_argument("--to", type=Path, required=True, help="node-local folder (created if missing)")
    parser.add_argument("--workers", type=int, default=8, help="files copied at once (threads)")
    parser.add_argument("--verify", action="store_true", help="check sha256 of copied and kept files")
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error("--workers must be positive")
    logs.configure("stage")
    try:
        if args.to.resolve() == args.manifest.parent.resolve():
            raise StageError(f"{args.to}: the source folder itself")
        done = stage(args.manifest, args.to, args.workers, args.verify)
    except (StageError, OSError) as error:
        log.error(f"staging failed: {error}")
        return 1
    log.info(f"{done['files']} files ({done['bytes'] / 1e9:.2f} GB) in {args.to}: copied "
             f"{done['copied_bytes'] / 1e9:.2f} GB, kept {done['kept_bytes'] / 1e9:.2f} GB already there, in "
             f"{done['seconds']:.1f} s ({done['bytes_per_s'] / 1e9:.2f} GB/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

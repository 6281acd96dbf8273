"""A run directory belongs to one run: its configuration's fingerprint, its lock, its leftovers.

Three things can mix or lose runs that share a ``run_dir`` (the default one is per experiment and
strategy, so two configurations of one strategy share it), and this module stops each of them
before any process group starts:

- **Another configuration.** The first run in a directory records its resolved configuration in
  ``run.json`` (with a SHA-256 over it: the fingerprint). A later start compares its own: keys
  that may change on a resume (``RESUMABLE_KEYS``: how long to train, logging, checkpoint cadence,
  where the data lies, timeouts and threads) are left out; any other difference is refused, naming
  the keys and both values, with the two ways out: a new ``run_dir``, or
  ``accept_config_change=[key,...]``, after which ``run.json`` records the change (when, which keys,
  old and new values) and the run goes on under the new fingerprint. A key the recording code did
  not know (added since) is not a difference. A directory written before fingerprints existed is
  adopted: compared with the ``config.yaml`` the old code wrote there, if any, then given a
  ``run.json``; the run's first line says so.
- **``resume=never`` in a used directory.** Everything an earlier run left (checkpoints, metrics,
  summaries, its ``run.json``) is moved aside to ``superseded/<UTC time>/`` under a name printed on
  the first line; nothing is deleted and nothing old stays where the new run prunes, resumes or
  appends. The same happens to checkpoints newer than the one a run resumes from (``set_aside``):
  an abandoned lineage, which pruning would otherwise keep in favour of the new one and the next
  ``resume=auto`` would pick.
- **Two jobs at once.** Rank 0 holds ``run.lock`` (job, host, pid, start; its modification time
  refreshed every ``LOCK_REFRESH_S`` by a daemon thread while the run lives). A second job is
  refused naming the first. A lock is stale when its host is this host and its pid is gone, or
  when it has not been refreshed for ``LOCK_STALE_S`` (a job that died on another node), or when
  it is this job's own (a requeued Slurm job, a restart by torchrun): then it is taken over, and
  the first line names the stale holder.

Rank 0 alone writes, moves and locks, before the process group: the other ranks only compare the
fingerprint, which they read from the shared file system (the file is replaced atomically, so a
reader sees the old or the new one whole). Leftovers of interrupted writes (``step_N.tmp``,
``step_N.old`` of an interrupted re-save) are tidied at the same time (``checkpoint.tidy``).
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator, Mapping, Optional

FINGERPRINT_FILE = "run.json"
LOCK_FILE = "run.lock"
SUPERSEDED = "superseded"
LOCK_REFRESH_S = 30.0
LOCK_STALE_S = 600.0  # 20 refreshes missed: the holder is gone, not slow
# What may change when a run is resumed: the length of the run and when it stops, what is logged and
# where, how often it checkpoints, where the (same) data lies and how it is read, timeouts, threads,
# and the checks that only stop a run. Everything else changes what is trained.
RESUMABLE_KEYS = (
    "epochs", "max_steps", "target_top1", "resume", "run_dir", "accept_config_change",
    "dist_timeout_s", "watchdog_s", "threads_per_rank", "save_final_params", "deterministic",
    "consistency_every_steps", "max_nonfinite_steps", "eval_every_epochs",
    "logger", "checkpoint", "data.root", "data.reader_workers", "data.num_threads", "data.prefetch",
    "data.verify_files",
)
# What lies in a run directory that belongs to the job or its launcher rather than to one run's
# lineage: the lock, what was set aside, the Slurm requeue record, NCCL's flight-recorder dumps
# and the launcher's per-rank logs (already open for the run that starts)
JOB_FILES = re.compile(rf"{re.escape(LOCK_FILE)}|{SUPERSEDED}|requeue\.state|nccl_trace_.*|rank\d+\.log")


class RunDirError(RuntimeError):
    """The run directory cannot be used as asked (another configuration, another job holds it, ...)."""


def write_atomically(path: Path, write: Callable[[BinaryIO], Any]) -> None:
    """``write(handle)`` into ``path`` through a temporary file beside it, fsynced and renamed into
    place: a reader (or a crash) sees the old file or the new one whole, never half of one."""
    path = Path(path)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        with open(partial, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(partial, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            partial.unlink()


def write_text_atomically(path: Path, text: str) -> None:
    write_atomically(path, lambda handle: handle.write(text.encode()))


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"optim": {"base_lr": 1}}`` -> ``{"optim.base_lr": 1}`` (lists stay values)."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def resumable(key: str) -> bool:
    return any(key == k or key.startswith(k + ".") for k in RESUMABLE_KEYS)


def identity(config: Mapping[str, Any]) -> dict[str, Any]:
    """The keys of a resolved configuration that make a run what it is (all but ``RESUMABLE_KEYS``)."""
    return {key: value for key, value in sorted(flatten(config).items()) if not resumable(key)}


def fingerprint(keys: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(keys, sort_keys=True, default=str).encode()).hexdigest()[:16]


def differences(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Keys whose value differs, as (recorded, current); a key only one side knows is no difference
    (code that added or removed a key since)."""
    return {key: (recorded[key], current[key]) for key in sorted(set(recorded) & set(current))
            if recorded[key] != current[key]}


def job_identity(env: Mapping[str, str] = os.environ) -> str:
    """What one job is across its restarts: a Slurm job id (kept by a requeue), torchrun's run id
    or, with a static rendezvous (whose run id is "none"), its store's address (kept by its
    restarts), else this process."""
    if env.get("SLURM_JOB_ID"):
        return f"slurm job {env['SLURM_JOB_ID']}"
    if env.get("TORCHELASTIC_RUN_ID", "none") != "none":  # a rendezvous id (--standalone: a uuid)
        return f"torchrun run {env['TORCHELASTIC_RUN_ID']}"
    if env.get("TORCHELASTIC_RUN_ID") and env.get("MASTER_PORT"):  # static rendezvous: its store's
        # address, which no other live job can hold
        return f"torchrun at {env.get('MASTER_ADDR', '?')}:{env['MASTER_PORT']}"
    return f"process {os.getpid()}"


def _stamp() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")


def _read_json(path: Path) -> Optional[dict]:
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        raise RunDirError(f"{path} is unreadable ({error}); move it away to adopt the directory afresh") from None
    return value if isinstance(value, dict) else None


def _recorded_config(run_dir: Path) -> tuple[Optional[dict], str]:
    """The identity keys recorded in ``run_dir`` and where they come from: ``run.json``, else the
    ``config.yaml`` that code from before fingerprints wrote, else none."""
    record = _read_json(run_dir / FINGERPRINT_FILE)
    if record is not None and isinstance(record.get("config"), dict):
        return record["config"], FINGERPRINT_FILE
    old = run_dir / "config.yaml"
    if old.exists():
        from omegaconf import OmegaConf

        try:
            return identity(OmegaConf.to_container(OmegaConf.load(old), resolve=False)), "config.yaml"
        except Exception:  # noqa: BLE001 - an unreadable old config adopts the directory as it is
            return None, ""
    return None, ""


def check_configuration(run_dir: Path, config: Mapping[str, Any], accepted: list[str]) -> dict[str, tuple]:
    """Every rank, before the process group: refuse to resume under another configuration
    (``RunDirError`` naming the differing keys and the ways out); returns the accepted changes."""
    recorded, source = _recorded_config(Path(run_dir))
    if recorded is None:
        return {}
    changed = differences(recorded, identity(config))
    refused = {key: values for key, values in changed.items() if key not in accepted}
    if refused:
        listed = "; ".join(f"{key}: {old!r} there, {new!r} now" for key, (old, new) in list(refused.items())[:8])
        more = f" (and {len(refused) - 8} more)" if len(refused) > 8 else ""
        keys = ",".join(refused)
        raise RunDirError(
            f"run_dir {run_dir} holds a run of another configuration ({source}): {listed}{more}. "
            f"Resuming it would mix two runs. Either give this configuration its own run_dir=..., or "
            f"resume that run with the change, recorded in {FINGERPRINT_FILE}: accept_config_change=[{keys}]")
    return changed


def _of_the_run(run_dir: Path) -> list[Path]:
    """What an earlier run left in ``run_dir`` (all but ``JOB_FILES``)."""
    if not Path(run_dir).is_dir():
        return []
    return sorted(p for p in Path(run_dir).iterdir() if not JOB_FILES.fullmatch(p.name))


def has_run(run_dir: Path) -> bool:
    """Whether an earlier run left anything of its own in ``run_dir``."""
    return bool(_of_the_run(run_dir))


def set_aside(run_dir: Path, paths: list[Path]) -> Optional[Path]:
    """Move ``paths`` (inside ``run_dir``) to ``run_dir/superseded/<UTC time>/``, keeping their
    places relative to ``run_dir``; returns that folder (None when there was nothing to move)."""
    paths = [p for p in paths if p.exists()]
    if not paths:
        return None
    target = Path(run_dir) / SUPERSEDED / _stamp()
    for path in paths:
        destination = target / path.relative_to(run_dir)
        destination.parent.mkdir(parents=True, exist_ok=True)
        os.rename(path, destination)
    return target


def set_aside_run(run_dir: Path) -> Optional[Path]:
    """``resume=never``: everything an earlier run left in ``run_dir`` goes to ``superseded/``."""
    return set_aside(run_dir, _of_the_run(run_dir))


@dataclass
class Lock:
    """``run.lock``: which job holds the run directory (written by rank 0, removed at its exit)."""

    path: Path
    job: str = field(default_factory=job_identity)
    host: str = field(default_factory=socket.gethostname)
    pid: int = field(default_factory=os.getpid)
    _stop: threading.Event = field(default_factory=threading.Event)
    _held: bool = False

    def describe(self, held: Mapping[str, Any]) -> str:
        age = time.time() - self.path.stat().st_mtime if self.path.exists() else float("nan")
        return (f"{held.get('job', '?')} (host {held.get('host', '?')}, pid {held.get('pid', '?')}, "
                f"since {held.get('started', '?')}, last refreshed {age:.0f} s ago)")

    def stale_because(self, held: Mapping[str, Any], now: Optional[float] = None) -> Optional[str]:
        """Why the lock ``held`` no longer guards a live run, or None while it does."""
        if held.get("job") == self.job:
            return "it is this job's own (a restart of the same job)"
        if held.get("host") == self.host and isinstance(held.get("pid"), int) and not _alive(held["pid"]):
            return f"its process {held['pid']} on this host is gone"
        age = (now or time.time()) - self.path.stat().st_mtime
        if age > LOCK_STALE_S:
            return f"it was last refreshed {age:.0f} s ago (stale after {LOCK_STALE_S:.0f} s)"
        return None

    def acquire(self) -> Optional[str]:
        """Take the lock (``RunDirError`` naming the holder when another live job has it); returns
        a line naming a stale holder that was replaced, else None."""
        said = None
        mine = {"job": self.job, "host": self.host, "pid": self.pid,
                "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        for _ in range(3):  # another job may be replacing a stale lock at the same moment
            try:
                descriptor = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                try:
                    held = json.loads(self.path.read_text())
                    held = held if isinstance(held, dict) else {}
                except (OSError, ValueError):
                    held = {}  # a lock torn by a crash: nobody holds it
                    reason = "it is unreadable (torn by a crash)"
                else:
                    reason = self.stale_because(held)
                if reason is None:
                    raise RunDirError(
                        f"run_dir {self.path.parent} is in use by {self.describe(held)}: two jobs in one run "
                        f"directory would prune each other's checkpoints and interleave their metrics. Wait "
                        f"for it to end or choose another run_dir=...; if that job is gone, remove "
                        f"{self.path}") from None
                said = f"took over the stale lock of {self.describe(held)}: {reason}"
                with contextlib.suppress(FileNotFoundError):
                    self.path.unlink()
                continue
            with os.fdopen(descriptor, "w") as handle:
                handle.write(json.dumps(mine))
                handle.flush()
                os.fsync(handle.fileno())
            self._held = True
            threading.Thread(target=self._refresh, name="gradientflow-run-lock", daemon=True).start()
            return said
        raise RunDirError(f"run_dir {self.path.parent}: could not take {self.path} (other jobs keep replacing it)")

    def _refresh(self) -> None:
        while not self._stop.wait(LOCK_REFRESH_S):
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def release(self) -> None:
        """Remove the lock if this object took it and it is still this process's."""
        self._stop.set()
        if not self._held:
            return
        self._held = False
        with contextlib.suppress(OSError, ValueError):
            held = json.loads(self.path.read_text())
            if held.get("pid") == self.pid and held.get("host") == self.host:
                self.path.unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


@dataclass
class Claim:
    """What ``claim`` did: the lock held (rank 0), and the lines the run prints first."""

    lock: Optional[Lock] = None
    said: list[str] = field(default_factory=list)

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()


def claim(run_dir: Path, config: Mapping[str, Any], *, resume: str, accepted: list[str], rank: int) -> Claim:
    """Before the process group, on every rank: the configuration checked against the directory's
    (unless ``resume=never``); on rank 0 also the lock taken, leftovers tidied, an earlier run set
    aside (``resume=never``) and the fingerprint written. ``RunDirError`` says what is wrong."""
    from gradientflow_repro import checkpoint

    run_dir = Path(run_dir)
    changed = {} if resume == "never" else check_configuration(run_dir, config, accepted)
    result = Claim()
    if rank != 0:
        return result
    run_dir.mkdir(parents=True, exist_ok=True)
    result.lock = Lock(run_dir / LOCK_FILE)
    try:
        stale = result.lock.acquire()
        if stale:
            result.said.append(f"run_dir {run_dir}: {stale}")
        tidied = checkpoint.tidy(run_dir)
        if tidied:
            result.said.append(f"removed {len(tidied)} unfinished checkpoint write(s): {', '.join(tidied)}")
        recorded = _read_json(run_dir / FINGERPRINT_FILE)
        if resume == "never":
            moved = set_aside_run(run_dir)
            if moved is not None:
                result.said.append(f"resume=never: the earlier run in {run_dir} was moved to {moved}")
            recorded = None
        keys = identity(config)
        if recorded is None:
            if has_run(run_dir):
                result.said.append(f"run_dir {run_dir} was written before run fingerprints: adopted as this "
                                   f"configuration's run (fingerprint {fingerprint(keys)})")
            record = {"fingerprint": fingerprint(keys), "config": keys, "changes": []}
        elif changed or recorded.get("config") != keys:  # accepted changes, or keys added since
            accepted_now = [{"time": _stamp(), "accepted": {k: list(v) for k, v in changed.items()}}] if changed else []
            record = {**recorded, "fingerprint": fingerprint(keys), "config": keys,
                      "changes": [*recorded.get("changes", []), *accepted_now]}
            if changed:
                result.said.append(f"accepted configuration change(s) in {run_dir}, recorded in "
                                   f"{FINGERPRINT_FILE}: " + "; ".join(f"{k}: {o!r} -> {n!r}"
                                                                     for k, (o, n) in changed.items()))
        else:
            record = None
        if record is not None:
            write_text_atomically(run_dir / FINGERPRINT_FILE, json.dumps(record, indent=1, default=str) + "\n")
    except BaseException:
        result.release()
        raise
    return result


@contextlib.contextmanager
def claimed(run_dir: Path, config: Mapping[str, Any], *, resume: str, accepted: list[str],
            rank: int) -> Iterator[Claim]:
    """``claim`` for the duration of the block; the lock is released however it ends."""
    result = claim(run_dir, config, resume=resume, accepted=accepted, rank=rank)
    try:
        yield result
    finally:
        result.release()

"""The train state: every part a checkpoint holds, each a Stateful (``state_dict``/``load_state_dict``).

Shared parts are the same on every rank and saved by rank 0 (``shared.pt``): the model's name and
weights, the optimizer, the precision policy (GradScaler), progress with both clocks, the wandb run
id (the Tracker). Per-rank parts differ between ranks and go to each rank's own file
(``rank_<r>.pt``): BatchNorm statistics (each rank normalises its own batches), the communicator's
state (CSC residuals), the torch and CUDA random generators. A ``TrainState`` holds them under the
keys they have on disk, writes them with ``checkpoint.save_checkpoint`` and restores them, in
order, from the files ``checkpoint.find_resumable`` found intact.

On-disk format: ``shared.pt`` and ``rank_<r>.pt`` are dicts with one entry per part, under the keys
below. ``shared.pt`` names its format under ``format``; checkpoints from before that key existed
have the same layout and are format 1.

Another number of ranks (a requeue on fewer or more nodes): the shared parts load as they are; each
per-rank part declares how its state maps (``rank_rule``: a rule for the whole state, or
``rank_rules()``: one per key of a dict state, as the communicator does):
- ``mean``: a new rank takes the mean over the old ranks (float tensors; integer tensors such as
  BatchNorm's ``num_batches_tracked``, equal on every rank, their mean rounded down). For CSC's
  residuals and velocities this keeps what the old ranks' average would have sent; for BatchNorm's
  local statistics it is the consensus model evaluation uses. Computed collectively: new rank j
  reads the old files i with i % new_world == j and sums them, then one all-reduce (SUM) per tensor
  and a division by the old world size; no rank reads every file.
- ``same``: equal on every old rank (settings, layouts, counters): old rank 0's, which new rank 0
  reads and broadcasts.
- ``own``: new rank r takes old rank r's (the RNG states); a rank with no old counterpart seeds its
  generators from (the checkpoint's step, its rank), so the streams differ between ranks and are
  reproducible.
A part without a rule cannot be mapped and the resume is refused, naming it and both world sizes.
``TrainState.regrouped`` then says in one line what was done; the run prints it.

A part added after checkpoints were written (so absent from their files) is refused, naming it,
unless it has ``absent_from_checkpoint()``: then it is called instead of ``load_state_dict`` and
the part starts from what that sets (for state whose absence only costs what the part would have
kept, e.g. precise BatchNorm's kept batches).
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Protocol

import torch
import torch.distributed as dist
from torch import nn

from gradientflow_repro import checkpoint
from gradientflow_repro.checkpoint import SHARED, CheckpointError, Group, load_file, rank_file, sources
from gradientflow_repro.distributed import barrier, mark_progress

FORMAT = 1  # shared: model_name, model, optimizer, precision, wandb_id, progress (its eval_pending
#             added since, read as False where absent);
#             per rank: buffers, comm, torch_rng, cuda_rng
MEAN, SAME, OWN = "mean", "same", "own"  # how per-rank state maps onto another number of ranks (above)


class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


class TrainingProgress:
    """Where training stands, and its clocks, which continue across resumes. ``mlperf_s`` is MLPerf's
    clock: it starts at ``start_clock`` (MLPerf's run_start: initialisation is over and no data has
    been touched yet), never pauses and includes evaluation. It is split into ``startup_s`` (clock
    start to each process's first step: listing and checking the data, building its pipelines),
    ``train_s`` (training steps), ``eval_s`` (evaluations) and what is left (waiting for the next
    batch between steps, logging, checkpoints).
    ``init_s``: initialisation before the clock (imports, process group, model, tracker, resume)."""

    def __init__(self) -> None:
        self.clock_start: Optional[float] = None  # this process's run_start (time.perf_counter)
        self.step = 0
        self.last_top1: Optional[float] = None
        self.best_top1: Optional[float] = None
        self.reached_at: Optional[dict] = None  # the clocks when the target was first reached
        self.eval_pending = False  # a stop at an epoch's end saved before its evaluation: do it first
        self.comm_totals = {"bytes": 0, "collectives": 0, "wait_s": 0.0}
        # the clocks of earlier (pre-resume) processes
        self._earlier = {"mlperf_s": 0.0, "train_s": 0.0, "eval_s": 0.0, "startup_s": 0.0, "init_s": 0.0}
        self._step_s = self._eval_s = self._init_s = 0.0  # this process's
        self._startup_s: Optional[float] = None  # this process's, once its first step has begun

    def start_clock(self, init_s: float) -> None:
        """MLPerf's run_start, after ``init_s`` seconds of initialisation."""
        self.clock_start, self._init_s = time.perf_counter(), init_s

    def _since_start(self) -> float:
        return 0.0 if self.clock_start is None else time.perf_counter() - self.clock_start

    @property
    def mlperf_s(self) -> float:
        return self._earlier["mlperf_s"] + self._since_start()

    @property
    def train_s(self) -> float:
        return self._earlier["train_s"] + self._step_s

    @property
    def eval_s(self) -> float:
        return self._earlier["eval_s"] + self._eval_s

    @property
    def startup_s(self) -> float:
        return self._earlier["startup_s"] + (self._since_start() if self._startup_s is None else self._startup_s)

    @property
    def init_s(self) -> float:
        return self._earlier["init_s"] + self._init_s

    def clocks(self) -> dict[str, float]:
        """Every clock now: MLPerf's and its parts, and the initialisation before it."""
        return {"mlperf_s": self.mlperf_s, "train_s": self.train_s, "eval_s": self.eval_s,
                "startup_s": self.startup_s, "init_s": self.init_s}

    def stepped(self, seconds: float) -> None:
        if self._startup_s is None:  # the first step of this process began ``seconds`` ago
            self._startup_s = max(0.0, self._since_start() - seconds)
        self.step += 1
        self._step_s += seconds

    def evaluated(self, seconds: float) -> None:
        self._eval_s += seconds

    def state_dict(self) -> dict:
        return {"step": self.step, **self.clocks(), "last_top1": self.last_top1, "best_top1": self.best_top1,
                "reached_at": self.reached_at, "comm_totals": dict(self.comm_totals),
                "eval_pending": self.eval_pending}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.last_top1, self.best_top1 = state["step"], state["last_top1"], state["best_top1"]
        self.reached_at, self.comm_totals = state["reached_at"], dict(state["comm_totals"])
        self.eval_pending = bool(state.get("eval_pending", False))  # absent from older checkpoints
        # checkpoints from before the clock was split have the first two only
        self._earlier = {key: state.get(key, 0.0) for key in self._earlier}


class ModelName:
    """The architecture's name: a checkpoint of another one is refused before its weights are read."""

    def __init__(self, name: str) -> None:
        self.name = name

    def state_dict(self) -> str:
        return self.name

    def load_state_dict(self, name: str) -> None:
        if name != self.name:
            raise CheckpointError(f"holds a {name} model, the config asks for {self.name}")


class ModelWeights:
    """The model as rank 0 has it; weights of other shapes (width, classes) are refused, naming the
    first mismatch. ``description`` says which model this run built."""

    def __init__(self, model: nn.Module, description: str) -> None:
        self.model, self.description = model, description

    def state_dict(self) -> dict:
        return self.model.state_dict()

    def load_state_dict(self, state: dict) -> None:
        try:
            self.model.load_state_dict(state)
        except RuntimeError as error:  # same architecture name, other shapes
            first = (str(error).splitlines() + [""])[1].strip()
            raise CheckpointError(f"does not fit this model ({self.description}): {first}; use "
                                  f"resume=never or another run_dir to start afresh") from None


class LocalBuffers:
    """This rank's BatchNorm statistics: each rank normalises its own batches, so they differ
    between ranks (loaded after the model, whose buffers are rank 0's). On another number of ranks
    each new rank takes their mean over the old ranks."""

    rank_rule, rank_label = MEAN, "BatchNorm buffers (num_batches_tracked: the mean rounded down)"

    def __init__(self, model: nn.Module, world_size: int) -> None:
        self.model, self.world_size = model, world_size

    def state_dict(self) -> list[torch.Tensor]:
        return [b.clone() for b in self.model.buffers()]

    def load_state_dict(self, saved: list[torch.Tensor]) -> None:
        for buffer, value in zip(self.model.buffers(), saved):
            buffer.copy_(value)

    @contextlib.contextmanager
    def averaged(self) -> Iterator[None]:
        """Collective: within, the buffers are the mean over ranks (the consensus model, for
        evaluation); after it, this rank's own again."""
        local = self.state_dict()
        if self.world_size > 1:
            for buffer in self.model.buffers():
                if buffer.is_floating_point():
                    dist.all_reduce(buffer)
                    buffer.div_(self.world_size)
        try:
            yield
        finally:
            self.load_state_dict(local)


class Value:
    """A Stateful made of a getter and a setter, for state that is not an object of its own.
    ``rank_rule``: how it maps onto another number of ranks (module docstring); ``reseed(seed)``:
    for the ``own`` rule, what a new rank without an old counterpart does instead."""

    def __init__(self, get: Callable[[], Any], put: Callable[[Any], None], rank_rule: Optional[str] = None,
                 reseed: Optional[Callable[[int], None]] = None) -> None:
        self._get, self._put = get, put
        self.rank_rule, self.reseed = rank_rule, reseed

    def state_dict(self) -> Any:
        return self._get()

    def load_state_dict(self, state: Any) -> None:
        self._put(state)


def rng_parts(device: torch.device) -> dict[str, Value]:
    """This rank's random generators (dropout differs between ranks): torch's, and CUDA's on a GPU."""
    cuda = device.type == "cuda"

    def set_cuda(state: Optional[torch.Tensor]) -> None:
        if state is not None and cuda:
            torch.cuda.set_rng_state(state)

    def seed_cuda(seed: int) -> None:
        if cuda:
            torch.cuda.manual_seed(seed)

    return {"torch_rng": Value(torch.get_rng_state, torch.set_rng_state, OWN, torch.default_generator.manual_seed),
            "cuda_rng": Value(lambda: torch.cuda.get_rng_state() if cuda else None, set_cuda, OWN, seed_cuda)}


def derived_seed(step: int, rank: int) -> int:
    """The seed of a new rank with no old counterpart: from the checkpoint's step and the rank."""
    return int.from_bytes(hashlib.sha256(f"resume step {step} rank {rank}".encode()).digest()[:8], "little") >> 1


def _sum_dtype(dtype: torch.dtype) -> torch.dtype:
    """What a sum over ranks is kept in: floats in their own type, integers in int64."""
    return dtype if dtype.is_floating_point else torch.int64


class _Meta:
    """A tensor's place in a broadcast skeleton: its shape and type, not its values."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.shape, self.dtype = tuple(tensor.shape), tensor.dtype


def _leaves(value: Any, kind: type = torch.Tensor) -> list[Any]:
    """The leaves of type ``kind`` in a state (tensors; ``_Meta`` in a skeleton), in a fixed order
    (dicts by key, as text): a state and its skeleton list their leaves alike."""
    if isinstance(value, kind):
        return [value]
    if isinstance(value, dict):
        return [leaf for key in sorted(value, key=str) for leaf in _leaves(value[key], kind)]
    if isinstance(value, (list, tuple)):
        return [leaf for item in value for leaf in _leaves(item, kind)]
    return []


def _skeleton(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return _Meta(value)
    if isinstance(value, dict):
        return {key: _skeleton(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_skeleton(item) for item in value)
    return value


def _fill(skeleton: Any, leaves: dict[int, torch.Tensor], at: list[int]) -> Any:
    """``skeleton`` with its ``_Meta`` replaced by ``leaves`` in ``_leaves``' order."""
    if isinstance(skeleton, _Meta):
        at[0] += 1
        return leaves[at[0] - 1]
    if isinstance(skeleton, dict):
        filled = {key: _fill(skeleton[key], leaves, at) for key in sorted(skeleton, key=str)}
        return {key: filled[key] for key in skeleton}
    if isinstance(skeleton, (list, tuple)):
        return type(skeleton)(_fill(item, leaves, at) for item in skeleton)
    return skeleton


def _rules(key: str, part: Stateful, state: Any) -> dict[Optional[str], str]:
    """The part's rule for each piece of its ``state`` (None: the whole state)."""
    if callable(getattr(part, "rank_rules", None)):
        rules = part.rank_rules()
        if not isinstance(state, dict):
            raise CheckpointError(f"per-rank part '{key}' declares rules per key, but its state is not a dict")
        unruled = sorted(str(k) for k in state if k not in rules)
        if unruled:
            raise CheckpointError(f"per-rank part '{key}' has no rule for {unruled} on another number of ranks")
        return {k: rules[k] for k in state}
    rule = getattr(part, "rank_rule", None)
    if rule is None:
        raise CheckpointError(f"per-rank part '{key}' has no rule for another number of ranks")
    return {None: rule}


def _starts_without_checkpoint(part: Stateful) -> bool:
    """Whether a checkpoint without ``part`` may still load (module docstring): the part then starts
    from what its ``absent_from_checkpoint()`` sets."""
    return callable(getattr(part, "absent_from_checkpoint", None))


class _Regroup:
    """Per-rank state of ``old`` ranks gathered for ``world`` new ones (module docstring): what this
    rank read (sums of ``mean`` pieces, its ``own`` pieces, on rank 0 the ``same`` pieces and the
    skeleton), then ``finish`` (collective) gives each part its state."""

    def __init__(self, parts: dict[str, Stateful], old: int, world: int, rank: int) -> None:
        self.parts, self.old, self.world, self.rank = parts, old, world, rank
        self.sums: dict[tuple, list[torch.Tensor]] = {}
        self.own: dict[tuple, Any] = {}
        self.layout: Optional[dict] = None  # rank 0: per piece, its rule and skeleton (or value)
        self.rules: dict[tuple, str] = {}
        self.absent: set[str] = set()  # parts the old files lack, which can start without them

    def add(self, old_rank: int, saved: dict, where: str) -> None:
        for key, part in self.parts.items():
            if key not in saved and _starts_without_checkpoint(part):
                self.absent.add(key)
                continue
            if key not in saved:
                raise CheckpointError(f"{where} has no '{key}' (written before this code's '{key}' existed?)")
            try:
                rules = _rules(key, part, saved[key])
            except CheckpointError as error:
                raise CheckpointError(f"{where}: written by {self.old} ranks, this job has {self.world}, and "
                                      f"{error}; resume on {self.old} ranks, or start afresh with "
                                      f"resume=never or another run_dir") from None
            for sub, rule in rules.items():
                value = saved[key] if sub is None else saved[key][sub]
                piece = (key, sub)
                self.rules[piece] = rule
                if rule == MEAN:
                    leaves = _leaves(value)
                    held = self.sums.get(piece)
                    if held is None:
                        self.sums[piece] = [t.to(_sum_dtype(t.dtype)).clone() for t in leaves]
                    else:
                        if [t.shape for t in held] != [t.shape for t in leaves]:
                            raise CheckpointError(f"{where}: '{key}' {sub or ''} differs in shape between old ranks")
                        for total, leaf in zip(held, leaves):
                            total.add_(leaf)
                elif rule == OWN:
                    if old_rank == self.rank:
                        self.own[piece] = value
                elif rule != SAME:
                    raise CheckpointError(f"per-rank part '{key}' has an unknown rule '{rule}'")
                if old_rank == 0:
                    if self.layout is None:
                        self.layout = {}
                    self.layout[piece] = (rule, _skeleton(value) if rule == MEAN else value if rule == SAME else None)

    def finish(self, group: Group, step: int) -> str:
        """Collective: load every part's mapped state; returns what was done, in words."""
        layout = group.broadcast(self.layout) or {}
        states: dict[str, Any] = {}
        reseeded = []
        problem = ""  # this rank's; agreed before any part loads (the all-reduces below stay in step)
        for piece, (rule, shape) in layout.items():
            key, sub = piece
            if rule == MEAN:
                metas = _leaves(shape, _Meta)
                totals = self.sums.get(piece) or [torch.zeros(m.shape, dtype=_sum_dtype(m.dtype)) for m in metas]
                if [tuple(t.shape) for t in totals] != [m.shape for m in metas]:
                    problem = problem or f"'{key}' {sub or ''}: shapes differ between old ranks 0 and others"
                    totals = [torch.zeros(m.shape, dtype=_sum_dtype(m.dtype)) for m in metas]
                means = {}
                for index, (total, meta) in enumerate(zip(totals, metas)):
                    if group.active:
                        on_device = total.to(group.device)
                        dist.all_reduce(on_device)
                        total = on_device.cpu()
                    means[index] = (total / self.old if total.is_floating_point()
                                    else torch.div(total, self.old, rounding_mode="floor")).to(meta.dtype)
                value = _fill(shape, means, [0])
            elif rule == SAME:
                value = shape
            else:
                value = self.own.get(piece)
                if piece not in self.own:
                    reseed = getattr(self.parts[key], "reseed", None)
                    if sub is not None or reseed is None:
                        problem = problem or (f"per-rank part '{key}': rank {self.rank} has no old counterpart "
                                              f"and the part cannot be reseeded")
                        continue
                    reseed(derived_seed(step, self.rank))
                    reseeded.append(key)
                    continue
            if sub is None:
                states[key] = value
            else:
                states.setdefault(key, {})[sub] = value
        failed = [r for r, flag in enumerate(group.flags(int(bool(problem)))) if flag]
        if failed:
            raise CheckpointError(f"on rank {failed[0]}: {group.all_gather(problem)[failed[0]]}")
        for key, part in self.parts.items():
            if key in states:
                part.load_state_dict(states[key])
            elif key in self.absent:
                part.absent_from_checkpoint()
        return self._describe(layout, reseeded)

    def _describe(self, layout: dict, reseeded: list) -> str:
        def label(key: str, sub: Optional[str]) -> str:
            part = self.parts[key]
            named = getattr(part, "rank_label", None) or key
            return named if sub is None else f"{named} {sub}"

        by_rule: dict[str, list[str]] = {}
        for (key, sub), (rule, _) in layout.items():
            by_rule.setdefault(rule, []).append(label(key, sub))
        def ranks(first: int, last: int) -> str:
            return f"rank {first}" if first == last else f"ranks {first}-{last}"

        said = []
        if by_rule.get(MEAN):
            said.append(f"{', '.join(by_rule[MEAN])} averaged over the {self.old} old ranks")
        if by_rule.get(SAME):
            said.append(f"{', '.join(by_rule[SAME])} from old rank 0 (equal on every rank)")
        if by_rule.get(OWN):
            kept = min(self.old, self.world)
            said.append(f"{', '.join(by_rule[OWN])}: {ranks(0, kept - 1)} keep their old rank's"
                        + (f", {ranks(kept, self.world - 1)} seeded from (step, rank)"
                           if self.world > self.old else ""))
        return f"resumed {self.old}-rank checkpoint on {self.world} ranks: " + "; ".join(said)


class TrainState:
    """The checkpointable parts of a run under their on-disk keys, restored in the order given."""

    def __init__(self, shared: dict[str, Stateful], per_rank: dict[str, Stateful], *, rank: int,
                 world_size: int, device: torch.device) -> None:
        self.shared, self.per_rank = shared, per_rank
        self.rank, self.world_size, self.device = rank, world_size, device
        self.saved_step = -1
        self.regrouped: Optional[str] = None  # after resuming another number of ranks: what was done
        self.set_aside: Optional[str] = None  # after resuming: newer checkpoints moved aside, in words

    @property
    def group(self) -> Group:
        return Group(self.device)

    def shared_state(self) -> dict:
        return {"format": FORMAT, **{key: part.state_dict() for key, part in self.shared.items()}}

    def rank_state(self) -> dict:
        return {key: part.state_dict() for key, part in self.per_rank.items()}

    def save(self, run_dir: Path, step: int, *, keep: int) -> Optional[Path]:
        """Collective: the checkpoint of ``step``, once (saving the same step again does nothing)."""
        if step == self.saved_step:
            return None
        mark_progress(f"checkpoint of step {step}")
        self.saved_step = step
        return checkpoint.save_checkpoint(run_dir, step, self.shared_state() if self.rank == 0 else None,
                                          self.rank_state(), rank=self.rank, world_size=self.world_size,
                                          barrier=lambda: barrier(self.device), keep=keep, group=self.group)

    def resume(self, run_dir: Path, mode: str) -> Optional[Path]:
        """Collective: load the checkpoint ``mode`` names (``auto``: the newest one intact on every
        rank in ``run_dir``, each rank checking the files it reads; ``never``: none; else a path,
        which must be intact). Returns it, or None when there was nothing to resume."""
        if mode == "never":
            return None
        group = self.group
        if mode == "auto":
            path = checkpoint.find_resumable(run_dir, group)
        else:
            path = Path(mode)
            problem = checkpoint.intact(path, group)
            if problem is not None:
                raise CheckpointError(f"{path} is {problem}")
        if path is not None:
            self.load(path)
            self._set_aside_newer(Path(run_dir), int(checkpoint.read_manifest(path)["step"]))
        return path

    def _set_aside_newer(self, run_dir: Path, step: int) -> None:
        """Collective: checkpoints in ``run_dir`` newer than the resumed ``step`` (damaged ones the
        resume skipped, or a lineage abandoned by ``resume=<older path>``) move to ``superseded/``:
        left in place, pruning would keep them over the new run's and ``resume=auto`` would pick
        them next time."""
        from gradientflow_repro.run_dir import set_aside

        problem = ""
        if self.rank == 0:
            newer = [p for p in checkpoint.complete_checkpoints(run_dir) if checkpoint.step_of(p) > step]
            try:
                moved = set_aside(run_dir, newer)
            except OSError as error:
                problem = f"rank 0: cannot move {[p.name for p in newer]} aside: {error}"
            else:
                if moved is not None:
                    self.set_aside = (f"moved {len(newer)} checkpoint(s) newer than step {step} "
                                      f"({', '.join(p.name for p in newer)}) to {moved}")
        group = self.group
        if any(group.flags(int(bool(problem)))):
            raise CheckpointError(group.broadcast(problem))

    def load(self, path: Path) -> None:
        """Collective: restore every part from ``path``; per-rank state of another number of ranks
        is mapped by the parts' rules (module docstring)."""
        group = self.group
        manifest = checkpoint.read_manifest(path)
        old = int(manifest["world_size"])
        regroup = _Regroup(self.per_rank, old, self.world_size, self.rank) if old != self.world_size else None
        problem, shared, mine = "", {}, {}
        try:  # every rank reads its files; errors are agreed before anything collective follows
            shared = load_file(Path(path) / SHARED)
            if regroup is None:
                mine = load_file(Path(path) / rank_file(self.rank))
            else:
                for old_rank in sources(self.rank, self.world_size, old):
                    where = Path(path) / rank_file(old_rank)
                    regroup.add(old_rank, load_file(where), str(where))
        except CheckpointError as error:
            problem = f"rank {self.rank}: {error}"
        failed = [r for r, flag in enumerate(group.flags(int(bool(problem)))) if flag]
        if failed:
            raise CheckpointError(group.all_gather(problem)[failed[0]])
        version = shared.get("format", 1)  # checkpoints written before the key: the same layout
        if version != FORMAT:
            raise CheckpointError(f"{path} is in checkpoint format {version}; this code reads format "
                                  f"{FORMAT}: resume it with the code that wrote it, or start afresh "
                                  f"with resume=never or another run_dir")
        for key, part in self.shared.items():
            self._restore(path, key, part, shared, "shared.pt", version)
        if regroup is None:
            for key, part in self.per_rank.items():
                self._restore(path, key, part, mine, "this rank's file", version)
            self.regrouped = None
        else:
            try:
                self.regrouped = regroup.finish(group, int(manifest["step"]))
            except CheckpointError as error:
                raise CheckpointError(f"{path} {error}") from None

    @staticmethod
    def _restore(path: Path, key: str, part: Stateful, saved: dict, where: str, version: int) -> None:
        if key not in saved:
            if _starts_without_checkpoint(part):  # written before the part existed
                part.absent_from_checkpoint()
                return
            raise CheckpointError(f"{path} has no '{key}' in {where} (checkpoint format {version}, written "
                                  f"before this code's '{key}' existed?); resume it with the code that wrote "
                                  f"it, or start afresh with resume=never or another run_dir")
        try:
            part.load_state_dict(saved[key])
        except CheckpointError as error:
            raise CheckpointError(f"{path} {error}") from None

"""The train state: every part a checkpoint holds, each a Stateful (``state_dict``/``load_state_dict``).

Shared parts are the same on every rank and saved by rank 0 (``shared.pt``): the model's name and
weights, the optimizer, the precision policy (GradScaler), progress with both clocks, the wandb run
id (the Tracker). Per-rank parts differ between ranks and go to each rank's own file
(``rank_<r>.pt``): BatchNorm statistics (each rank normalises its own batches), the communicator's
state (CSC residuals), the torch and CUDA random generators. A ``TrainState`` holds them under the
keys they have on disk, writes them with ``checkpoint.save_checkpoint`` and restores them, in
order, from ``checkpoint.load_checkpoint``.

On-disk format: ``shared.pt`` and ``rank_<r>.pt`` are dicts with one entry per part, under the keys
below. ``shared.pt`` names its format under ``format``; checkpoints from before that key existed
have the same layout and are format 1.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Protocol

import torch
import torch.distributed as dist
from torch import nn

from gradientflow_repro import checkpoint
from gradientflow_repro.checkpoint import CheckpointError
from gradientflow_repro.distributed import barrier, mark_progress

FORMAT = 1  # shared: model_name, model, optimizer, precision, wandb_id, progress;
#             per rank: buffers, comm, torch_rng, cuda_rng


class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


class Progress:
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
                "reached_at": self.reached_at, "comm_totals": dict(self.comm_totals)}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.last_top1, self.best_top1 = state["step"], state["last_top1"], state["best_top1"]
        self.reached_at, self.comm_totals = state["reached_at"], dict(state["comm_totals"])
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
    between ranks (loaded after the model, whose buffers are rank 0's)."""

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
    """A Stateful made of a getter and a setter, for state that is not an object of its own."""

    def __init__(self, get: Callable[[], Any], put: Callable[[Any], None]) -> None:
        self._get, self._put = get, put

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

    return {"torch_rng": Value(torch.get_rng_state, torch.set_rng_state),
            "cuda_rng": Value(lambda: torch.cuda.get_rng_state() if cuda else None, set_cuda)}


class TrainState:
    """The checkpointable parts of a run under their on-disk keys, restored in the order given."""

    def __init__(self, shared: dict[str, Stateful], per_rank: dict[str, Stateful], *, rank: int,
                 world_size: int, device: torch.device) -> None:
        self.shared, self.per_rank = shared, per_rank
        self.rank, self.world_size, self.device = rank, world_size, device
        self.saved_step = -1

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
                                   barrier=lambda: barrier(self.device), keep=keep)

    def resume(self, run_dir: Path, mode: str) -> Optional[Path]:
        """Collective: load the checkpoint ``mode`` names (``auto``: the newest intact one in
        ``run_dir``; ``never``: none; else a path), chosen by rank 0 for every rank. Returns it,
        or None when there was nothing to resume."""
        if mode == "never":
            return None
        path = [checkpoint.find_resumable(run_dir) if mode == "auto" else Path(mode)]
        if dist.is_initialized():  # rank 0 decides, so every rank resumes from the same one
            dist.broadcast_object_list(path, src=0)
        if path[0] is not None:
            self.load(path[0])
        return path[0]

    def load(self, path: Path) -> None:
        shared, mine = checkpoint.load_checkpoint(path, self.rank, self.world_size)
        version = shared.get("format", 1)  # checkpoints written before the key: the same layout
        if version != FORMAT:
            raise CheckpointError(f"{path} is in checkpoint format {version}; this code reads format "
                                  f"{FORMAT}: resume it with the code that wrote it, or start afresh "
                                  f"with resume=never or another run_dir")
        for parts, saved, where in ((self.shared, shared, "shared.pt"), (self.per_rank, mine, "this rank's file")):
            for key, part in parts.items():
                if key not in saved:
                    raise CheckpointError(f"{path} has no '{key}' in {where} (checkpoint format {version})")
                try:
                    part.load_state_dict(saved[key])
                except CheckpointError as error:
                    raise CheckpointError(f"{path} {error}") from None

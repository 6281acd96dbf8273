"""A test double for how NCCL orders work, on gloo processes.

What NCCL (through PyTorch's ProcessGroupNCCL, with the communicator created eagerly by
``init_process_group(device_id=...)``) does, and this double does too:
- every operation of one process group, collective or point-to-point, runs on that group's one
  stream, one at a time, in the order the rank issued it;
- a send may not complete before its receiver runs the matching receive (NCCL is allowed to block
  there: a rendezvous, the worst case for small messages and the rule for large ones);
- ``batch_isend_irecv`` runs its sends and receives together, as one group (``ncclGroupStart/End``);
  plain ``isend``/``irecv`` are groups of one;
- collectives return before they finish; ``wait()`` orders later work after them;
- a future's callbacks never block the stream (NCCL completes a work's future as its kernel is
  queued; its callbacks may issue and wait for more collectives, as PyTorch's PowerSGD hook does):
  here they run on a thread of their own once the op has run.

Under the double an op that can never run (a receive queued before the send it waits for) makes
the waiting rank raise ``StreamHang`` within ``timeout_s``, naming the op, instead of hanging.

With ``claim_nccl=True`` the process group also says it is NCCL (``dist.get_backend`` answers
"nccl"), so code that chooses by backend (the factory's ``knobs.summing``, ``small_sum``, the fp16
wire) builds and runs its NCCL path on gloo's CPU tensors. The context yields the ``Counts`` of the
ops issued under it (point-to-point calls and collectives), so a test can tell NCCL's allreduce
from our point-to-point algorithms.

Use it inside a spawned gloo worker::

    with nccl_order(timeout_s=10) as counts:
        ring_allreduce_(tensor)
    assert counts.p2p > 0

It patches ``torch.distributed``'s functions for the duration; creating it is collective (it makes
one extra gloo group for the rendezvous messages).
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
import queue
import threading
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

DATA_TAG = 0  # NCCL ignores tags: messages between two ranks of a group match in issue order only


class StreamHang(RuntimeError):
    """An op did not complete within the double's timeout: under NCCL the job would hang here."""


@dataclass
class Counts:
    """Ops issued under the double: ``p2p`` counts calls of isend, irecv and batch_isend_irecv."""

    p2p: int = 0
    collectives: int = 0


class _Work:
    """What the double's ops return: ``wait()`` blocks until the stream has run the op;
    ``get_future()`` completes (with ``result``) when it has, as a ProcessGroup's work does."""

    def __init__(self, description: str, stream: "_Stream", result: Optional[list] = None) -> None:
        self.description, self.stream, self.result = description, stream, result or []
        self.done = threading.Event()
        self.error: Optional[BaseException] = None
        self.future: Optional[torch.futures.Future] = None
        self.lock = threading.Lock()

    def get_future(self) -> torch.futures.Future:
        with self.lock:
            if self.future is None:
                self.future = torch.futures.Future()
                if self.done.is_set():
                    self._settle()
            return self.future

    def _settle(self) -> None:
        if self.error is not None:
            self.future.set_exception(self.error)
        else:
            self.future.set_result(self.result)

    def finish(self) -> None:
        """Called by the stream when the op has run (or failed). A future's callbacks run on a thread
        of their own, never on the stream's: under NCCL a callback that issues and waits for another
        collective (PyTorch's PowerSGD hook does, for P and Q) never holds up the group's stream."""
        with self.lock:
            self.done.set()
            future = self.future
        if future is not None:
            threading.Thread(target=self._settle, name="nccl-order-callbacks", daemon=True).start()

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> bool:
        limit = self.stream.timeout_s * 2
        if not self.done.wait(limit):
            raise StreamHang(f"rank {dist.get_rank()}: {self.description} did not complete within "
                             f"{limit:.0f} s ({self.stream.describe()})")
        if self.error is not None:
            raise self.error
        return True

    def is_completed(self) -> bool:
        return self.done.is_set()


class _Stream:
    """One NCCL stream: a thread that runs the group's ops in issue order, each to completion."""

    def __init__(self, name: str, timeout_s: float) -> None:
        self.name, self.timeout_s = name, timeout_s
        self.queue: "queue.Queue[Optional[tuple[Callable[[], None], _Work]]]" = queue.Queue()
        self.issued = 0
        self.running = ""
        self.broken: Optional[BaseException] = None
        self.thread = threading.Thread(target=self._loop, name=f"nccl-order-{name}", daemon=True)
        self.thread.start()

    def describe(self) -> str:
        return f"stream of {self.name}, running: {self.running or 'nothing'}"

    def submit(self, run: Callable[[], None], description: str, result: Optional[list] = None) -> _Work:
        self.issued += 1
        work = _Work(f"op #{self.issued} on {self.name} ({description})", self, result)
        self.queue.put((run, work))
        return work

    def _loop(self) -> None:
        while (item := self.queue.get()) is not None:
            run, work = item
            self.running = work.description
            if self.broken is not None:  # a stream stuck in an op never runs the ones behind it
                work.error = StreamHang(f"{work.description} queued behind a hung op: {self.broken}")
            else:
                try:
                    run()
                except RuntimeError as error:  # gloo: a timeout, or a link a peer dropped at its own
                    self.broken = work.error = StreamHang(  # timeout: either way this op never ran
                        f"rank {dist.get_rank()}: {work.description} never met its partner within "
                        f"{self.timeout_s:.0f} s: {str(error).splitlines()[0][:200]}")
                except BaseException as error:  # noqa: BLE001 - handed to whoever waits
                    self.broken = work.error = error
            self.running = ""
            work.finish()

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join(timeout=self.timeout_s)


@contextlib.contextmanager
def nccl_order(timeout_s: float = 10.0, claim_nccl: bool = False) -> Iterator[Counts]:
    """Patch ``torch.distributed`` so this process behaves as an NCCL rank would (see above);
    ``claim_nccl``: and says its backend is NCCL."""
    original = {name: getattr(dist, name) for name in
                ("isend", "irecv", "batch_isend_irecv", "all_reduce", "broadcast", "reduce",
                 "all_gather", "barrier", "get_backend")}
    counts = Counts()
    control = dist.new_group(backend="gloo")  # collective: carries the "ready to receive" tokens
    timeout = datetime.timedelta(seconds=timeout_s)
    streams: dict[Any, _Stream] = {}
    lock = threading.Lock()

    def stream_of(group: Optional[dist.ProcessGroup]) -> tuple[_Stream, dist.ProcessGroup]:
        group = group if group is not None else c10d._get_default_group()
        with lock:
            if group not in streams:
                streams[group] = _Stream(f"group {group.group_name}", timeout_s)
            return streams[group], group

    def control_tag(group: dist.ProcessGroup) -> int:
        return zlib.crc32(group.group_name.encode()) % (1 << 20)

    def run_p2p_group(group: dist.ProcessGroup, ops: list[tuple[str, torch.Tensor, int, int]]) -> None:
        """One NCCL group: every receive first tells its sender it is ready, then every send waits
        for that word from its receiver; only then does data move. The caller's tags are ignored,
        as NCCL ignores them."""
        tag = control_tag(group)
        works, tokens = [], []
        for kind, tensor, peer, data_tag in ops:
            if kind == "recv":
                token = torch.ones(1)
                tokens.append(token)
                works.append(original["isend"](token, dst=peer, group=control, tag=tag))
                works.append(original["irecv"](tensor, src=peer, group=group, tag=DATA_TAG))
        for kind, tensor, peer, data_tag in ops:
            if kind == "send":
                token = torch.zeros(1)
                original["irecv"](token, src=peer, group=control, tag=tag).wait(timeout)
                works.append(original["isend"](tensor, dst=peer, group=group, tag=DATA_TAG))
        for work in works:
            work.wait(timeout)

    def submit_p2p(group: Optional[dist.ProcessGroup], ops: list[tuple[str, torch.Tensor, int, int]]) -> _Work:
        stream, group = stream_of(group)
        description = ", ".join(f"{kind} {'to' if kind == 'send' else 'from'} rank {peer} "
                                f"({tensor.numel()} el, tag {tag})" for kind, tensor, peer, tag in ops)
        return stream.submit(lambda: run_p2p_group(group, ops), description)

    def isend(tensor: torch.Tensor, dst: Optional[int] = None, group: Optional[dist.ProcessGroup] = None,
              tag: int = 0, group_dst: Optional[int] = None) -> _Work:
        counts.p2p += 1
        return submit_p2p(group, [("send", tensor, _global(group, dst, group_dst), tag)])

    def irecv(tensor: torch.Tensor, src: Optional[int] = None, group: Optional[dist.ProcessGroup] = None,
              tag: int = 0, group_src: Optional[int] = None) -> _Work:
        counts.p2p += 1
        return submit_p2p(group, [("recv", tensor, _global(group, src, group_src), tag)])

    def batch_isend_irecv(p2p_op_list: list[dist.P2POp]) -> list[_Work]:
        counts.p2p += 1
        if not p2p_op_list:
            raise ValueError("batch_isend_irecv: empty op list (NCCL rejects it too)")
        groups = {id(op.group) for op in p2p_op_list}
        if len(groups) != 1:
            raise ValueError("All ops need to use the same group.")
        ops = [("send" if op.op in (isend, original["isend"]) else "recv", op.tensor, op.peer, op.tag)
               for op in p2p_op_list]
        return [submit_p2p(p2p_op_list[0].group, ops)]

    def collective(name: str) -> Callable[..., Optional[_Work]]:
        function = original[name]
        signature = inspect.signature(function)

        def on_stream(*args: Any, **kwargs: Any) -> Optional[_Work]:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            async_op = bound.arguments.pop("async_op", False)
            stream, _ = stream_of(bound.arguments.get("group"))
            call = dict(bound.arguments)
            counts.collectives += 1
            tensor = call.get("tensor")
            work = stream.submit(lambda: function(**call), name, [tensor] if tensor is not None else [])
            if async_op:
                return work
            work.wait()
            return None
        return on_stream

    def get_backend(group: Optional[dist.ProcessGroup] = None) -> str:
        return "nccl"

    patched = {"isend": isend, "irecv": irecv, "batch_isend_irecv": batch_isend_irecv,
               **{name: collective(name) for name in ("all_reduce", "broadcast", "reduce",
                                                       "all_gather", "barrier")},
               **({"get_backend": get_backend} if claim_nccl else {})}
    try:
        for name, function in patched.items():
            setattr(dist, name, function)
        # P2POp checks that its op is c10d's isend/irecv: let it accept the patched ones
        c10d.isend, c10d.irecv = isend, irecv
        yield counts
        for stream in list(streams.values()):  # drain: everything issued must have completed
            stream.submit(lambda: None, "drain").wait()
    finally:
        for name, function in original.items():
            setattr(dist, name, function)
        c10d.isend, c10d.irecv = original["isend"], original["irecv"]
        for stream in streams.values():
            stream.close()


def _global(group: Optional[dist.ProcessGroup], peer: Optional[int], group_peer: Optional[int]) -> int:
    if peer is not None:
        return peer
    return group_peer if group is None else dist.get_global_rank(group, group_peer)

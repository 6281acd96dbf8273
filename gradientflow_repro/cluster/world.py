"""A process group on this machine for tests and benchmarks: a free port, and a function run in N
new processes (forked from multiprocessing's fork server) that form one gloo (or NCCL) world.

``spawn(fn, world, *args)`` starts ``world`` processes; each joins the group on 127.0.0.1 with a
timeout, runs ``fn(rank, world, *args)``, meets the others at a barrier (nobody tears its
connections down while a peer may still be reading) and leaves through
``distributed.destroy_process_group_and_exit``: it exits without finalizing the interpreter, which
keeps gloo's worker thread from aborting a passing run during tear-down. A failure in any rank
fails ``spawn``. ``run_rank`` is the same for a rank started by someone else (``init_method``
``env://`` under ``cluster.launch.run_ranks``).

Only the standard library is imported at module level (``gpu_check`` uses ``free_port``).
"""

from __future__ import annotations

import datetime
import socket
from typing import Any, Callable, NoReturn


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_rank(fn: Callable[..., Any], rank: int, world: int, init_method: str, *args: Any,
             backend: str = "gloo", timeout_s: float = 60.0) -> NoReturn:
    """Join the group as ``rank`` of ``world`` (one torch thread; with NCCL on GPU ``rank``), run
    ``fn(rank, world, *args)``, then barrier and exit through ``destroy_process_group_and_exit``.
    An exception destroys the group and propagates (the process then exits with it)."""
    import torch
    import torch.distributed as dist

    from gradientflow_repro.distributed import destroy_process_group_and_exit

    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(torch.device("cuda", rank))
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        fn(rank, world, *args)
        dist.barrier()  # nobody tears its connections down while a peer may still be reading
    except BaseException:
        dist.destroy_process_group()
        raise
    destroy_process_group_and_exit()


def _spawned(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple, backend: str,
             timeout_s: float) -> None:
    run_rank(fn, rank, world, f"tcp://127.0.0.1:{port}", *args, backend=backend, timeout_s=timeout_s)


# What every process imports, imported once by multiprocessing's fork server that the processes
# are forked from (a fresh interpreter per process would import them anew, which would cost most of
# a small test's time). torch._dynamo is there because any optimizer
# imports it on first use. Importing starts no thread and touches no GPU, so forking stays safe.
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "gradientflow_repro.distributed",
           "gradientflow_repro.comm.factory"]


def spawn(fn: Callable[..., Any], world: int, *args: Any, backend: str = "gloo", timeout_s: float = 60.0) -> None:
    """Run ``fn(rank, world, *args)`` in ``world`` new processes forming one ``backend`` group on
    127.0.0.1 (collective timeout ``timeout_s``); a failure in any rank fails. The processes come
    from the fork server (``PRELOAD``), each prepared as a spawned one is (the caller's ``sys.path``,
    ``fn`` and ``args`` pickled), so ``fn`` must be importable by name. Their environment variables
    are the server's, from when it started (the first ``spawn`` of this process): pass what a rank
    needs in ``args``, not through ``os.environ``."""
    import multiprocessing

    import torch.multiprocessing as mp

    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)  # read when the server starts
    mp.start_processes(_spawned, args=(world, free_port(), fn, args, backend, timeout_s), nprocs=world,
                       join=True, start_method="forkserver")

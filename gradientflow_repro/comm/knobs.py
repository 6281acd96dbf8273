"""The shared ``comm.*`` keys and the rules of how a message is summed.

Every strategy is a preset of five independent knobs; any knob can be overridden from the command
line (``comm=ring comm.wire=fp16``) to build the paper's ablation one technique at a time:

| knob      | values                        | technique                                          |
|-----------|-------------------------------|----------------------------------------------------|
| algorithm | builtin, ring, hierarchical,  | how a message is summed (ring.py, hierarchical.py; |
|           | auto                          | auto: hierarchical on several multi-rank nodes)    |
| wire      | fp32, fp16                    | mixed-precision communication (compression.py)     |
| fusion    | per_tensor, lazy, ddp         | per-tensor messages, memory pool (lazy.py), or DDP |
| overlap   | true, false                   | pool parts sent during backward (lazy only)        |
| sparsity  | dense, csc, powersgd, ...     | a sparsifier (csc/, powersgd.py; registry.py)      |

and one more key, ``implementation`` (not part of the presets: every preset takes ``auto``), says
who carries the algorithm's messages: ``ours`` (ring.py, recursive_doubling.py, hierarchical.py,
loops of point-to-point ops issued from Python), ``backend`` (the process group's own allreduce:
NCCL's or gloo's), or ``auto``: the backend on NCCL, ours elsewhere (``summing``).

``CommConfig`` declares the keys every strategy shares (with their checks); a sparsifier declares
its own in its module (``csc.CSCKeys``). ``plan.resolve`` lays a configuration over its preset and
checks both into one ``Plan``. Torch-free: imported by the config check and the analytic model.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union

from gradientflow_repro.checks import (
    boolean,
    non_negative,
    one_of,
    optional,
    positive,
    setting,
    text,
)
from gradientflow_repro.comm import registry

# Our own algorithms send a message of at most this many bytes by recursive doubling rather than the
# ring (``comm/recursive_doubling.py``): below it log2(N) latencies beat the ring's 2(N-1), above it
# the ring's bandwidth-optimal volume wins. The value is the smallest switch-over measured over world
# sizes 2, 4 and 8 on loopback (results/small_allreduce.md); a network of another latency x bandwidth
# has another (``comm.small_message_kb``). Here, torch-free, because the scaling model prices the same rule.
SMALL_MESSAGE_BYTES = 1 << 20
# CSC under momentum correction and LARS: buckets of each layer's noise sketch (comm/csc/trust.py,
# TrustNoise), which ride with the chunk norms; here, torch-free, because the model counts them.
TRUST_SKETCH_BUCKETS = 64
# sparsity: the package's sparsifiers (``plan.resolve`` checks every registered one)
KNOB_VALUES: dict[str, tuple[Any, ...]] = {
    "algorithm": ("builtin", "ring", "hierarchical", "auto"), "wire": ("fp32", "fp16"),
    "fusion": ("per_tensor", "lazy", "ddp"), "overlap": (True, False), "sparsity": ("dense", *registry.BUILTIN)}
# comm.implementation: who carries an algorithm's messages (``summing``)
IMPLEMENTATIONS = ("auto", "backend", "ours")


def presets() -> dict[str, dict[str, Any]]:
    """Every strategy: name -> the keys its preset sets (``configs/comm/NAME.yaml``, strategy aside).
    Raises ValueError for a preset that misses a knob: a preset sets every knob."""
    found = {}
    for name in registry.names():
        values = registry.preset(name)
        missing = [knob for knob in KNOB_VALUES if knob not in values]
        if missing:
            raise ValueError(f"preset {name!r}: a preset sets every knob; missing {', '.join(missing)}")
        found[name] = values
    return found


@dataclass
class CommConfig:
    """``comm.*``. ``strategy`` names a preset; a knob left null takes the preset's value, a set one
    overrides it, so each technique can be switched alone."""

    strategy: str = setting("allreduce", text)  # a preset's name (``plan.resolve``)
    algorithm: Optional[str] = setting(None, optional(one_of(*KNOB_VALUES["algorithm"])))
    wire: Optional[str] = setting(None, optional(one_of(*KNOB_VALUES["wire"])))
    fusion: Optional[str] = setting(None, optional(one_of(*KNOB_VALUES["fusion"])))
    overlap: Optional[bool] = setting(None, optional(boolean))  # lazy: send pool parts during backward
    sparsity: Optional[str] = setting(None, optional(text))  # a registered sparsifier (``plan.resolve``)
    # who sums: NCCL's/gloo's own allreduce ("backend") or our point-to-point algorithms ("ours");
    # "auto": the backend on NCCL (one kernel per message, all of a node's NICs), ours elsewhere
    # (measured against gloo). Not a preset's knob: every preset takes auto (``summing``)
    implementation: str = setting("auto", one_of(*IMPLEMENTATIONS))
    bucket_mb: float = setting(32.0, positive)  # lazy-allreduce pool part (fusion threshold)
    ddp_bucket_mb: float = setting(25.0, positive)
    segment_kb: int = setting(4096, positive)  # ring: pipelining segment
    # our algorithms: messages up to this size by recursive doubling; null: SMALL_MESSAGE_BYTES (measured
    # on loopback); a network of another latency x bandwidth has another switch-over
    small_message_kb: Optional[int] = setting(None, optional(positive))
    ranks_per_node: Optional[int] = setting(None, optional(positive))  # hierarchical: else the launcher's
    # the sparsifiers' dense warm-up (CSC's, PowerSGD's): null, as long as the learning rate's warm-up
    # (optim.warmup_epochs), so they sparsify once the learning rate has peaked (``plan.Plan.warmup_epochs``)
    csc_warmup_epochs: Optional[float] = setting(None, optional(non_negative))
    # the module that declares this preset's sparsifier, where the package does not ship it
    # (``registry.BUILTIN``): a strategy from outside the package brings its own (docs/extending.md)
    module: Optional[str] = setting(None, optional(text))


def two_level(algorithm: str, world: int, ranks_per_node: Optional[int]) -> bool:
    """Whether ``algorithm`` sums over two levels (inside nodes, then among node leaders) for
    ``world`` ranks placed ``ranks_per_node`` per node: always for ``hierarchical``; for ``auto``
    when there is more than one node and more than one rank per node (else the flat ring)."""
    if algorithm == "hierarchical":
        return True
    per_node = ranks_per_node or 1
    return algorithm == "auto" and 1 < per_node < world


@dataclass(frozen=True)
class Summing:
    """What sums a message, for one job: the one definition that the factory builds
    (``factory.build_sum``), the run's first lines print (``plan.describe_sum``) and the scaling
    model prices (``perfmodel``).

    ``how``: ``backend`` (the process group's own allreduce, one call per message), ``ring`` (our
    flat ring, ``ring.py``) or ``two-level`` (our reduce / leaders' ring / broadcast,
    ``hierarchical.py``); ours send messages up to ``small_message_bytes`` by our recursive
    doubling. On NCCL the backend's allreduce is NCCL's as its tuner picks it (ring or tree by size
    and topology): no configuration sets NCCL_ALGO, because NCCL reads it once for the whole job,
    and forcing its ring would send every small message (the step's agreement, the fp16 wire's
    peak) around a ring of all ranks in the strategies that asked for it and not in the others, a
    bias in a comparison of strategies (``docs/strategies.md``, On NCCL). A user's NCCL_ALGO
    applies to every strategy alike."""

    how: str
    backend: str

    @property
    def ours(self) -> bool:
        return self.how != "backend"


def implementation_of(algorithm: str, implementation: str, backend: str) -> str:
    """``backend`` or ``ours``: who carries ``algorithm``'s messages on ``backend`` ("nccl", "gloo").

    ``builtin`` is the backend's allreduce by definition. Otherwise ``comm.implementation`` decides;
    ``auto`` takes the backend on NCCL and ours elsewhere. Why: on NCCL our algorithms issue 2(N-1)
    ``batch_isend_irecv`` groups per message from Python (1,022 at 512 ranks), each a separate launch
    serialised on the communicator's one stream, and the two-level ring crosses between nodes
    through local rank 0's NIC only; NCCL's own allreduce runs one kernel per message whose rings and
    trees span every NIC of the node (one channel per rail). On gloo (CPU tensors) ours are what the
    ladder measures, each compared with gloo's own allreduce (results/allreduce.md,
    results/small_allreduce.md)."""
    if algorithm == "builtin":
        return "backend"
    if implementation == "auto":
        return "backend" if backend == "nccl" else "ours"
    return implementation


def summing(algorithm: str, world: int, ranks_per_node: Optional[int], backend: str = "gloo",
            implementation: str = "auto") -> Summing:
    """What sums ``algorithm``'s messages for ``world`` ranks placed ``ranks_per_node`` per node on
    ``backend`` under ``comm.implementation``: see ``Summing``, ``implementation_of``, ``two_level``."""
    if world > 1 and implementation_of(algorithm, implementation, backend) == "backend":
        return Summing("backend", backend)
    if world > 1 and two_level(algorithm, world, ranks_per_node):
        return Summing("two-level", backend)
    return Summing("ring" if world > 1 else "backend", backend)


def check_overlap(knobs: CommConfig, backend: str) -> None:
    """Refuse what cannot overlap with backward on ``backend``: DDP's buckets summed by our
    algorithms on NCCL. DDP runs a communication hook inside backward and overlaps only when the
    hook returns a future that completes later; ours are loops of point-to-point groups that finish
    before the hook returns, so every bucket would stall backward (on gloo, CPU tensors, it runs so,
    synchronously, as measured). Raises ValueError naming the keys."""
    if (knobs.fusion == "ddp" and backend == "nccl"
            and implementation_of(knobs.algorithm, knobs.implementation, backend) == "ours"):
        raise ValueError(f"config keys 'comm.fusion' = 'ddp' and 'comm.implementation' = "
                         f"{knobs.implementation!r} (comm.algorithm={knobs.algorithm}) on NCCL: DDP would run our "
                         f"point-to-point algorithm synchronously inside backward, so nothing overlaps; use "
                         f"comm.implementation=backend (NCCL's allreduce, overlapped) or comm.fusion=lazy "
                         f"(our pool overlaps on its own thread)")


def check_backend(options: Union[Mapping[str, Any], Any], backend: str,
                  environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """Before the process group starts: refuse what ``check_overlap`` refuses for ``options`` on
    ``backend``. Returns the NCCL_ALGO in force (a user's, from ``environ``; None: unset): no
    configuration sets it (``Summing``)."""
    from gradientflow_repro.comm.plan import resolve

    environ = os.environ if environ is None else environ
    check_overlap(resolve(options), backend)
    return environ.get("NCCL_ALGO") or None


def describe_nccl_algo(environ: Optional[Mapping[str, str]] = None) -> str:
    """NCCL_ALGO in words: the user's, for every strategy alike, or NCCL's tuner."""
    actual = (os.environ if environ is None else environ).get("NCCL_ALGO")
    if actual:
        return f"NCCL_ALGO={actual} from the environment, for every strategy alike"
    return "NCCL_ALGO unset: ring or tree by size"



def hydra_overrides(options: Mapping[str, Any]) -> list[str]:
    """The command-line overrides that select ``options``: ``comm=NAME`` then ``comm.KEY=VALUE``, as
    ``++comm.KEY=VALUE`` for a key neither shared nor set by the preset (a sparsifier's own: added)."""
    strategy = options.get("strategy", "allreduce")
    shared = {f.name for f in dataclasses.fields(CommConfig)} | set(registry.preset(strategy))
    rest = [f"{'' if key in shared else '++'}comm.{key}={str(value).lower() if isinstance(value, bool) else value}"
            for key, value in options.items() if key != "strategy"]
    return [f"comm={strategy}", *rest]


def on_network(options: Mapping[str, Any], small_message_kb: Optional[int]) -> dict[str, Any]:
    """``options`` with ``small_message_kb`` (a network's switch-over from recursive doubling to the
    ring, measured there) where they sum with our own algorithms; the backend's allreduce picks its
    own. None: as they are."""
    from gradientflow_repro.comm.plan import resolve

    if small_message_kb is None or resolve(options).algorithm == "builtin":
        return dict(options)
    return {**options, "small_message_kb": small_message_kb}

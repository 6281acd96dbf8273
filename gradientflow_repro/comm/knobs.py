"""Communication strategies: the knobs, the presets, and how a configuration resolves to one.

A strategy is a preset of five independent knobs; any knob can be overridden from the command
line (``comm=ring comm.wire=fp16``) to build the paper's ablation one technique at a time:

| knob      | values                        | technique                                          |
|-----------|-------------------------------|----------------------------------------------------|
| algorithm | builtin, ring, hierarchical,  | how a message is summed (ring.py, hierarchical.py; |
|           | auto                          | auto: hierarchical on several multi-rank nodes)    |
| wire      | fp32, fp16                    | mixed-precision communication (compression.py)     |
| fusion    | per_tensor, lazy, ddp         | per-tensor messages, memory pool (lazy.py), or DDP |
| overlap   | true, false                   | pool parts sent during backward (lazy only)        |
| sparsity  | dense, csc (registry.py)      | coarse-grained sparse communication (csc/)         |

and one more key, ``implementation`` (not part of the presets: every preset takes ``auto``), says
who carries the algorithm's messages: ``ours`` (ring.py, recursive_doubling.py, hierarchical.py,
loops of point-to-point ops issued from Python), ``backend`` (the process group's own allreduce:
NCCL's or gloo's), or ``auto``: the backend on NCCL, ours elsewhere (``summing``).

The presets are the YAML files of ``configs/comm/`` (Hydra's pattern: the preset is the YAML): each
names its strategy and sets all five knobs and its sizes. Which strategies exist, their labels
(``ring+fp16`` is the ring preset with the fp16 wire), the lists they belong to and how the model
prices them are in the registry, ``registry.py``: this module checks a configuration against it,
so the trainer (through Hydra), the factory, the scaling model and ``make reproduce`` all see one
definition. ``resolve`` lays a configuration over its preset and over ``CommConfig``'s defaults and
returns a ``CommConfig`` with every knob set, for registered strategies and sparsifiers only.
``LADDER`` (the paper's ablation as ``make reproduce`` runs it), ``SPARSE_VARIANTS`` and
``COMPARED`` are the registry's lists, label -> ``comm.*`` options, read when asked for.
Torch-free: imported by the config check and the analytic model.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Union

from gradientflow_repro.checks import (
    boolean,
    field_problems,
    in_range,
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
PRESET_DIR: Path = registry.PRESET_DIR
# sparsity: the sparsifiers registered when this module loads (``resolve`` checks the registry's own)
KNOB_VALUES: dict[str, tuple[Any, ...]] = {
    "algorithm": ("builtin", "ring", "hierarchical", "auto"), "wire": ("fp32", "fp16"),
    "fusion": ("per_tensor", "lazy", "ddp"), "overlap": (True, False), "sparsity": tuple(registry.SPARSIFIERS)}
# comm.implementation: who carries an algorithm's messages (``summing``)
IMPLEMENTATIONS = ("auto", "backend", "ours")


def presets() -> dict[str, dict[str, Any]]:
    """Every registered strategy: name -> the keys its preset sets (``configs/comm/NAME.yaml``,
    strategy aside). Raises ValueError for a preset that misses a knob, and for a YAML of
    ``configs/comm/`` that the registry does not know."""
    stray = registry.unregistered_presets()
    if stray:
        raise ValueError(f"configs/comm/{stray[0]}.yaml: no entry in the strategy registry (comm/registry.py)")
    return {name: _preset(name) for name in registry.names()}


def _preset(name: str) -> dict[str, Any]:
    """Strategy ``name``'s preset, which must set every knob (ValueError naming the missing ones)."""
    values = registry.preset(name)
    missing = [knob for knob in KNOB_VALUES if knob not in values]
    if missing:
        raise ValueError(f"preset {name!r}: a preset sets every knob; missing {', '.join(missing)}")
    return values


def _strategy_names() -> tuple[str, ...]:
    return registry.names()


@dataclass
class CommConfig:
    """``comm.*``. ``strategy`` names a preset; a knob left null takes the preset's value, a set one
    overrides it, so each technique can be switched alone."""

    strategy: str = setting("allreduce", text)  # checked against the presets in ``resolve``
    algorithm: Optional[str] = setting(None, optional(one_of(*KNOB_VALUES["algorithm"])))
    wire: Optional[str] = setting(None, optional(one_of(*KNOB_VALUES["wire"])))
    fusion: Optional[str] = setting(None, optional(one_of(*KNOB_VALUES["fusion"])))
    overlap: Optional[bool] = setting(None, optional(boolean))  # lazy: send pool parts during backward
    sparsity: Optional[str] = setting(None, optional(text))  # checked against the registry in ``resolve``
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
    chunk_size: int = setting(32768, positive)  # csc: elements per chunk
    density: float = setting(0.1, in_range(0, 1, low_open=True))  # csc: fraction of chunks sent
    # csc: dense training before sparsifying; null: as long as the learning rate's warm-up
    # (optim.warmup_epochs), so CSC sparsifies once the learning rate has peaked (``csc_warmup``)
    csc_warmup_epochs: Optional[float] = setting(None, optional(non_negative))
    density_ramp_epochs: int = setting(0, non_negative)  # csc: epochs over which density falls
    momentum_correction: bool = setting(True, boolean)
    momentum_masking: bool = setting(True, boolean)
    # csc: with momentum_masking, mask only the sent chunks that waited more than this many steps since
    # their last send; 0: every sent chunk (DGC's rule). Masking erases the momentum still due to a
    # chunk's last sends, which DGC meant for chunks sent every ~1,000 steps, not every ~1/density
    masking_min_wait: float = setting(0.0, non_negative)
    # csc under momentum correction and LARS: rank chunks by the norm of the trust-rescaled velocity
    # ("rescaled": what is sent) or of the same divided by its layer's trust ratio ("raw": the gradients
    # that built it up; what is sent is unchanged)
    rank_by: str = setting("rescaled", one_of("rescaled", "raw"))
    # csc under momentum correction: weight decay rides in the sent velocity ("velocity") or keeps a
    # velocity of its own on each rank, applied every step and never sent ("local": DGC's reference
    # optimizer, dgc/optim/sgd.py; refused under LARS on several ranks: each rank's own trust ratio
    # would rescale it differently and the weights would drift apart)
    weight_decay_in: str = setting("velocity", one_of("velocity", "local"))
    # csc: a chosen chunk sends at most this many times the norm of what the step added to it (its
    # velocity under momentum correction), the rest staying in the residual; 0: no cap (DGC's rule)
    release_cap: float = setting(0.0, in_range(0, math.inf, high_open=True))
    # csc under momentum correction and LARS: each rank's trust ratio corrected for the noise of its
    # own gradient, estimated from sketches that ride with the chunk norms (comm/csc/trust.py, TrustNoise)
    trust_noise_correction: bool = setting(True, boolean)
    # powersgd: rank of the low-rank factors (PyTorch's matrix_approximation_rank); its dense warm-up
    # is csc_warmup_epochs, as CSC's
    powersgd_rank: int = setting(4, positive)


def resolve(options: Union[Mapping[str, Any], Any]) -> CommConfig:
    """``options`` (a mapping or a config object with ``comm.*`` keys) over its preset over the
    defaults: a ``CommConfig`` with every knob set, checked. Raises ValueError naming the
    ``comm.*`` key at fault."""
    given = dict(options) if isinstance(options, Mapping) else {
        f.name: getattr(options, f.name) for f in dataclasses.fields(CommConfig) if hasattr(options, f.name)}
    strategy = given.get("strategy", "allreduce")
    if strategy not in registry.STRATEGIES:
        raise ValueError(f"config key 'comm.strategy' = {strategy!r}: allowed values are "
                         f"{', '.join(_strategy_names())}")
    unknown = sorted(set(given) - {f.name for f in dataclasses.fields(CommConfig)})
    if unknown:
        raise ValueError(f"config key 'comm.{unknown[0]}': no such key")
    merged = {**_preset(strategy), **{k: v for k, v in given.items() if v is not None}}
    knobs = CommConfig(**merged)
    for key, value, allowed in field_problems(CommConfig, knobs, "comm."):
        raise ValueError(f"config key '{key}' = {value!r}: {allowed}")
    needed = registry.sparsifier(knobs.sparsity).required_fusion
    if needed == "lazy" and knobs.fusion != "lazy":
        raise ValueError(f"config key 'comm.sparsity' = {knobs.sparsity!r} works over our memory pool: it needs "
                         "comm.fusion=lazy (not DDP's buckets or per-tensor messages)")
    if needed is not None and knobs.fusion != needed:
        raise ValueError(f"config key 'comm.fusion' = {knobs.fusion!r}: comm.sparsity={knobs.sparsity} needs "
                         f"comm.fusion={needed}")
    return knobs


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
    (``factory.build_sum``), the run's first lines print (``factory.describe_sum``) and the scaling
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
    environ = os.environ if environ is None else environ
    check_overlap(resolve(options), backend)
    return environ.get("NCCL_ALGO") or None


def describe_nccl_algo(environ: Optional[Mapping[str, str]] = None) -> str:
    """NCCL_ALGO in words: the user's, for every strategy alike, or NCCL's tuner."""
    actual = (os.environ if environ is None else environ).get("NCCL_ALGO")
    if actual:
        return f"NCCL_ALGO={actual} from the environment, for every strategy alike"
    return "NCCL_ALGO unset: ring or tree by size"



def small_message_bytes(knobs: CommConfig) -> int:
    """Up to how many bytes our algorithms send a message by recursive doubling."""
    return knobs.small_message_kb * 1024 if knobs.small_message_kb else SMALL_MESSAGE_BYTES


def sends_sparse(knobs: CommConfig) -> bool:
    """Some steps send only part of the gradients, or an approximation of them: a sparsifier (CSC's
    below density 1; PowerSGD's low-rank factors, which have no density): not the same SGD as dense."""
    pricing = registry.sparsifier(knobs.sparsity).pricing
    return pricing == "low_rank" or (pricing != "dense" and knobs.density < 1)


def csc_warmup(knobs: CommConfig, lr_warmup_epochs: float) -> float:
    """Epochs CSC trains densely before it sparsifies: ``comm.csc_warmup_epochs``, or where that is
    null (the presets) the learning rate's warm-up, ``lr_warmup_epochs``. Sparsifying while the
    learning rate still climbs cost the digits recipe an epoch to its target and, over the whole
    schedule, a fall of 20 points; from the peak on it cost none (docs/notes/2026-12-02-csc-dense-warmup.md)."""
    return lr_warmup_epochs if knobs.csc_warmup_epochs is None else knobs.csc_warmup_epochs


def dense_warmup_epochs(knobs: CommConfig, lr_warmup_epochs: float) -> float:
    """Epochs a strategy trains densely before its steps show its steady state (CSC's warm-up, which
    PowerSGD's follows)."""
    return csc_warmup(knobs, lr_warmup_epochs) if sends_sparse(knobs) else 0.0


def __getattr__(name: str) -> dict[str, dict[str, Any]]:
    """The registry's lists as label -> ``comm.*`` options, read when asked for (so a strategy
    registered later is in them): ``LADDER``, the paper's ablation as ``make reproduce`` runs it,
    each rung adding one technique; ``SPARSE_VARIANTS``, trained beside it for CSC's convergence
    cost (not rungs of the speed ladder, which the model checks); ``PEERS``, what researchers would
    use instead (PyTorch's fp16 and PowerSGD hooks) and the paper's stack as published; ``COMPARED``,
    all three: every configuration ``make reproduce`` trains to the target."""
    if name == "LADDER":
        return registry.options_of(registry.LADDER)
    if name == "SPARSE_VARIANTS":
        return registry.options_of(registry.SPARSE_VARIANTS)
    if name == "PEERS":
        return registry.options_of(registry.PEERS)
    if name == "COMPARED":
        return {**registry.options_of(registry.LADDER), **registry.options_of(registry.SPARSE_VARIANTS),
                **registry.options_of(registry.PEERS)}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def hydra_overrides(options: Mapping[str, Any]) -> list[str]:
    """The command-line overrides that select ``options``: ``comm=NAME`` then ``comm.KEY=VALUE``."""
    rest = [f"comm.{key}={str(value).lower() if isinstance(value, bool) else value}"
            for key, value in options.items() if key != "strategy"]
    return [f"comm={options.get('strategy', 'allreduce')}", *rest]


def on_network(options: Mapping[str, Any], small_message_kb: Optional[int]) -> dict[str, Any]:
    """``options`` with ``small_message_kb`` (a network's switch-over from recursive doubling to the
    ring, measured there) where they sum with our own algorithms; the backend's allreduce picks its
    own. None: as they are."""
    if small_message_kb is None or resolve(options).algorithm == "builtin":
        return dict(options)
    return {**options, "small_message_kb": small_message_kb}

"""A communication configuration resolved once: the immutable ``Plan`` everything builds and prices from.

``resolve(options, ...)`` is the one place where ``comm.*`` options become decisions:

1. the strategy's preset (``registry.preset``) under the options given (a null option keeps the
   preset's value);
2. the keys split by owner: the shared ones (``knobs.CommConfig``: how a message is summed, the
   wire, the fusion, the sizes, the sparse warm-up) and those of the chosen sparsifier (its own
   ``keys`` dataclass, declared in its module: ``csc.CSCKeys``, ``powersgd.PowerSGDKeys``), each
   checked by its declaration; a key nobody declares is refused, naming it, and so is a key of
   another sparsifier (``comm.density`` on a dense strategy means nothing);
3. the sparsifier's fusion rule (CSC needs the pool, PowerSGD DDP's buckets);
4. where the job is known (world size, backend, ranks per node, the learning rate's warm-up): which
   sum carries the messages (``knobs.summing``), the small-message switch-over, the dense warm-up.

The factory builds the communicator from the plan in one pass (``factory.build``), the run's first
lines describe it (``describe``), and the scaling model prices it (``scaling/pricing.py``): none of
them reads an option again. Torch-free: the config check and the analytic model import it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import Any, Mapping, Optional, Union

from gradientflow_repro.checks import field_problems
from gradientflow_repro.comm import registry
from gradientflow_repro.comm.knobs import SMALL_MESSAGE_BYTES, CommConfig, Summing, summing

SHARED_KEYS = tuple(f.name for f in fields(CommConfig))


@dataclass(frozen=True)
class Plan:
    """What a job's communication is, decided: the shared keys (``CommConfig``'s), the sparsifier
    and its own keys, and the job it runs in (for one rank, no warm-up, gloo, when not given)."""

    config: CommConfig
    keys: Any = None  # the sparsifier's own keys (an instance of its ``keys`` dataclass), or None
    world: int = 1
    backend: str = "gloo"
    layout_ranks_per_node: Optional[int] = None  # the launcher's, unless comm.ranks_per_node overrides it
    local_rank: Optional[int] = None  # the launcher's; None where comm.ranks_per_node emulates nodes
    lr_warmup_epochs: float = 0.0
    ignored: tuple[str, ...] = ()  # keys given for another sparsifier than this plan's, left out

    def __getattr__(self, name: str) -> Any:
        # the shared keys read as the plan's own: plan.wire, plan.fusion, plan.bucket_mb ...
        if name in SHARED_KEYS:
            return getattr(self.config, name)
        raise AttributeError(f"{type(self).__name__!r} has no attribute {name!r}")

    @property
    def sparsifier(self) -> registry.Sparsifier:
        return registry.sparsifier(self.config.sparsity)

    @property
    def summing(self) -> Summing:
        """What sums a message in this job (``knobs.summing``)."""
        return summing(self.config.algorithm, self.world, self.layout_ranks_per_node, self.backend,
                       self.config.implementation)

    @property
    def small_message_bytes(self) -> int:
        """Up to how many bytes our algorithms send a message by recursive doubling."""
        kb = self.config.small_message_kb
        return kb * 1024 if kb else SMALL_MESSAGE_BYTES

    @property
    def bucket_bytes(self) -> int:
        """The lazy pool's part size."""
        return int(self.config.bucket_mb * 2**20)

    @property
    def sends_sparse(self) -> bool:
        """Some steps send only part of the gradients, or an approximation of them (not the same SGD
        as dense): the sparsifier says, from its keys (CSC below density 1; PowerSGD always)."""
        return self.sparsifier.sends_sparse(self.keys)

    @property
    def warmup_epochs(self) -> float:
        """Epochs the sparsifier trains densely first: ``comm.csc_warmup_epochs``, or where that is
        null (the presets) the learning rate's warm-up. Sparsifying while the learning rate still
        climbs cost the digits recipe an epoch to its target and, over the whole schedule, a fall of
        20 points; from the peak on it cost none (docs/notes/2026-12-02-csc-dense-warmup.md)."""
        given = self.config.csc_warmup_epochs
        return self.lr_warmup_epochs if given is None else given

    @property
    def dense_warmup_epochs(self) -> float:
        """Epochs before the steps show the strategy's steady state (0 for dense strategies)."""
        return self.warmup_epochs if self.sends_sparse else 0.0

    def options(self) -> dict[str, Any]:
        """The resolved ``comm.*`` options, flat: the shared keys, then the sparsifier's."""
        keys = {f.name: getattr(self.keys, f.name) for f in fields(self.keys)} if self.keys is not None else {}
        return {**dataclasses.asdict(self.config), **keys}


def _given(options: Union[Mapping[str, Any], Any]) -> dict[str, Any]:
    if isinstance(options, Plan):
        return options.options()
    if isinstance(options, Mapping) or hasattr(options, "items"):
        return dict(options.items())
    return {name: getattr(options, name) for name in dir(options) if not name.startswith("_")}


def _owners() -> dict[str, registry.Sparsifier]:
    """Every registered sparsifier's key -> that sparsifier."""
    return {key: declared for declared in registry.sparsifiers().values() for key in declared.key_names()}


def _checked(schema: type, values: Mapping[str, Any]) -> Any:
    chosen = schema(**values)
    for key, value, allowed in field_problems(schema, chosen, "comm."):
        raise ValueError(f"config key '{key}' = {value!r}: {allowed}")
    return chosen


def _checked_key(schema: type, key: str, value: Any) -> None:
    """Refuse ``value`` of ``schema``'s key ``key`` as its declaration does, naming it."""
    spec = next(f for f in fields(schema) if f.name == key)
    problem = spec.metadata["check"].problem(value)
    if problem:
        raise ValueError(f"config key 'comm.{key}' = {value!r}: {problem}")


def resolve(options: Union[Mapping[str, Any], Any], *, world: int = 1, backend: str = "gloo",
            ranks_per_node: Optional[int] = None, local_rank: Optional[int] = None,
            lr_warmup_epochs: float = 0.0) -> Plan:
    """``options`` (``comm.*``: a mapping, a config node or a ``Plan``) over its preset, resolved
    into a ``Plan`` for a job of ``world`` ranks on ``backend``, placed ``ranks_per_node`` per node
    (the launcher's; ``comm.ranks_per_node`` overrides it), whose learning rate warms up over
    ``lr_warmup_epochs``. Keys of a sparsifier other than the chosen one (an experiment's
    ``comm.chunk_size`` for whichever strategy runs under it; a record written when every key was
    everyone's) are checked by their own declaration, then left out: ``Plan.ignored`` names them.
    Raises ValueError naming the key at fault."""
    given = _given(options)
    strategy = given.get("strategy") or "allreduce"
    merged = {**registry.preset(strategy), **{k: v for k, v in given.items() if v is not None},
              "strategy": strategy}
    sparsifier = registry.sparsifier(merged.get("sparsity") or "dense")
    own = set(sparsifier.key_names())
    ignored, foreign = [], sorted(set(merged) - set(SHARED_KEYS) - own)
    owners = _owners() if foreign else {}
    for key in foreign:
        owner = owners.get(key)
        if owner is None:
            raise ValueError(f"config key 'comm.{key}': no such key (comm.sparsity={sparsifier.name} takes "
                             f"{', '.join(sorted(own)) or 'none of its own'})")
        _checked_key(owner.keys, key, merged.pop(key))
        ignored.append(key)
    config = _checked(CommConfig, {k: v for k, v in merged.items() if k in SHARED_KEYS})
    keys = _checked(sparsifier.keys, {k: v for k, v in merged.items() if k in own}) if sparsifier.keys else None
    if sparsifier.fusion == "lazy" and config.fusion != "lazy":
        raise ValueError(f"config key 'comm.sparsity' = {config.sparsity!r} works over our memory pool: it needs "
                         "comm.fusion=lazy (not DDP's buckets or per-tensor messages)")
    if sparsifier.fusion is not None and config.fusion != sparsifier.fusion:
        raise ValueError(f"config key 'comm.fusion' = {config.fusion!r}: comm.sparsity={config.sparsity} needs "
                         f"comm.fusion={sparsifier.fusion}")
    if config.ranks_per_node:  # emulated nodes: the launcher's local rank says nothing about that layout
        ranks_per_node, local_rank = config.ranks_per_node, None
    return Plan(config, keys, world, backend, ranks_per_node, local_rank, lr_warmup_epochs, tuple(ignored))


def describe_schedule(plan: Plan) -> str:
    """The sparsifier's schedule in words, its dense warm-up resolved (``comm.csc_warmup_epochs``
    null shows as null in the run's saved config); empty for dense strategies."""
    if not plan.sends_sparse:
        return ""
    warmup = plan.warmup_epochs
    why = "the learning rate's warm-up" if plan.config.csc_warmup_epochs is None else "comm.csc_warmup_epochs"
    sparsifier = plan.sparsifier
    if warmup:
        start = f"dense for the first {warmup:g} epoch(s) ({why}), then"
    elif sparsifier.dense_steps:
        start = f"dense for {sparsifier.dense_steps} steps, then"
    else:
        start = "sparse from the first step:"
    return f"{start} {sparsifier.in_words(plan.keys)}"


def describe_sum(plan: Plan, nccl_algo: str = "") -> str:
    """What sums the messages, in words, for the run's first lines: NCCL's allreduce with the
    NCCL_ALGO in force (``nccl_algo``, ``knobs.describe_nccl_algo``), or ours (with the size up to
    which they send by recursive doubling)."""
    world, backend = plan.world, plan.backend
    if world == 1:
        return "one rank: nothing to sum"
    chosen = plan.summing
    if chosen.how == "backend" and backend == "nccl":
        how = f"NCCL's allreduce ({nccl_algo}) over {world} ranks"
    elif chosen.how == "backend":
        how = f"the backend's allreduce ({backend}) over {world} ranks"
    else:
        per_node = plan.layout_ranks_per_node
        how = {"two-level": f"two-level ring ({-(-world // (per_node or 1))} nodes x {per_node} ranks)",
               "ring": f"flat ring over {world} ranks"}[chosen.how]
        if backend == "nccl":  # ours, asked for by name: point-to-point, its small messages included
            how = f"our {how} (comm.implementation=ours: point-to-point groups issued from Python)"
        how += f", small messages (up to {plan.small_message_bytes // 1024} KiB) by recursive doubling"
    return how + (", fp16 wire" if plan.config.wire == "fp16" else "")

"""A communication strategy as the scaling model prices it, read from the plan the factory builds.

The one place where the model reads communication configurations: ``Strategy.from_plan`` turns a
resolved ``comm/plan.Plan`` (the same one the factory builds from) into the model's view (fusion,
overlap, wire width, who sums, and what the sparsifier sends, priced by its rule:
``scaling/pricing.py``), ``strategy_of`` a label (``variants.py``), ``ladder`` the ablation ladder of
`make reproduce`; the labels a projection knows (``strategy_options``, ``parse_strategies``,
``default_strategies``) and one priced with a setup's part size and density (``priced``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from gradientflow_repro import variants
from gradientflow_repro.comm import knobs as comm_knobs
from gradientflow_repro.comm.plan import Plan, resolve
from gradientflow_repro.scaling import lineup, pricing

if TYPE_CHECKING:
    from gradientflow_repro.scaling.network import Network


@dataclass(frozen=True)
class Strategy:
    name: str
    fusion: str = "per_tensor"  # per_tensor | bucket
    bucket_bytes: float = 25 * 2**20
    overlap: bool = False
    wire_bytes: int = 4
    density: float = 1.0
    chunk_elements: int = 32768
    algorithm: str = "ring"  # builtin | ring | hierarchical | auto, as ``comm.algorithm``
    # as ``comm.implementation`` (``knobs.summing``); by hand: our algorithms (``from_plan``: the
    # configuration's, auto by default: NCCL's allreduce on an NCCL network). Not compared: a rung is
    # the same strategy (the same messages) whoever carries them; the pricing asks ``summing``
    implementation: str = field(default="ours", compare=False)
    small_message_bytes: float = comm_knobs.SMALL_MESSAGE_BYTES  # recursive doubling up to here
    # CSC's trust-ratio noise sketches ride with the chunk norms (momentum correction under LARS)
    noise_sketch: bool = False
    # CSC's momentum correction does the optimizer's momentum, weight decay and adaptation
    takes_optimizer: bool = False
    # PowerSGD (``low_rank`` pricing): its matrix approximation rank (``comm.powersgd_rank``); 0: not low-rank
    low_rank: int = 0
    # PowerSGD compresses a matrix only where it shrinks by more than this (PowerSGDState's default, 2)
    min_compression_rate: float = 2.0
    # the fp16 wire agrees on one power-of-two scale per message (a small allreduce, ours); PyTorch's
    # fp16_compress_hook divides by the world size before the cast and agrees on none
    shared_scale: bool = True

    @classmethod
    def from_plan(cls, name: str, plan: Plan, lars: bool = True) -> "Strategy":
        """The model's view of a resolved ``comm`` configuration (``comm.plan.resolve``), as
        ``comm/factory.py`` builds it: DDP and the lazy pool fuse into buckets (DDP of
        ``ddp_bucket_mb``, always overlapped; the pool of ``bucket_mb``, overlapped if ``overlap``).
        ``lars``: the optimizer is LARS (the paper's), so CSC under momentum correction sends the
        noise sketches of its trust ratios (``comm/csc/``, ``TrustNoise``).

        What the sparsifier sends is priced by its rule (``pricing.RULES``: ``dense``, ``chunks``,
        ``csc``, ``low_rank``); a rule not known there raises ValueError, so a new sparsifier is
        never priced as dense by mistake. DDP's fp16 wire with ``comm.algorithm=builtin`` is
        PyTorch's ``fp16_compress_hook`` (no shared scale), as the factory builds it; under any
        other algorithm it keeps our shared scale, on NCCL's allreduce too."""
        sent = pricing.price(name, plan.sparsifier, plan.keys, lars)
        fusion = "bucket" if plan.fusion in ("lazy", "ddp") else "per_tensor"
        bucket_mb = plan.ddp_bucket_mb if plan.fusion == "ddp" else plan.bucket_mb
        return cls(name, fusion=fusion,
                   bucket_bytes=int(bucket_mb * 2**20) if fusion == "bucket" else cls.bucket_bytes,
                   overlap=plan.fusion == "ddp" or (plan.fusion == "lazy" and bool(plan.overlap)),
                   wire_bytes=2 if plan.wire == "fp16" else 4, algorithm=plan.algorithm,
                   implementation=plan.implementation, small_message_bytes=plan.small_message_bytes,
                   shared_scale=not (plan.wire == "fp16" and plan.fusion == "ddp" and plan.algorithm == "builtin"),
                   **sent)

    @property
    def builtin(self) -> bool:
        return self.algorithm == "builtin"

    def summing(self, ranks: int, net: "Network") -> comm_knobs.Summing:
        """What sums this strategy's messages over ``ranks`` ranks on ``net`` (``knobs.summing``)."""
        return comm_knobs.summing(self.algorithm, ranks, net.ranks_per_node, "nccl" if net.nccl else "gloo",
                                  self.implementation)

    def ours(self, ranks: int, net: "Network") -> bool:
        """Whether our algorithms carry the messages (then small ones by recursive doubling)."""
        return ranks > 1 and self.summing(ranks, net).ours


def strategy_of(label: str, lars: bool = True) -> Strategy:
    """The model's view of a label (``variants.options``: a label, an old one, or a strategy's
    name), as ``from_plan`` prices it."""
    return Strategy.from_plan(variants.canonical(label), resolve(variants.options(label)), lars=lars)



def ladder() -> tuple[Strategy, ...]:
    """The ablation ladder of `make reproduce` (``reproduction/lineup.py``) as the model sees it."""
    from gradientflow_repro.reproduction.lineup import LADDER_LABELS

    return tuple(strategy_of(label) for label in LADDER_LABELS)


def strategy_options() -> dict[str, dict]:
    """Strategies the projection knows, label -> ``comm`` options: every preset by its name and every
    label of ``variants.py`` (the ablation ladder, where ``gradientflow`` takes the two-level ring on
    multi-GPU nodes: ``comm.algorithm=auto``; the full stack forced onto the flat ring; ...). Labels
    that take their layout from a benchmark (``ranks_per_node``) are left out."""
    return {label: dict(variant.options) for label, variant in variants.variants().items()
            if not variant.layout_keys}


def parse_strategies(value: str) -> tuple[str, ...]:
    """Strategy labels from one command-line value: the value itself where it is a label (or an old
    one, ``variants.canonical``), else a comma-separated list of them. Raises ValueError naming the
    allowed labels."""
    options = strategy_options()
    if variants.canonical(value.strip()) in options:
        return (variants.canonical(value.strip()),)
    chosen = tuple(variants.canonical(part.strip()) for part in value.split(",") if part.strip())
    unknown = [label for label in chosen if label not in options]
    if unknown or not chosen:
        raise ValueError(f"unknown strategy {', '.join(map(repr, unknown)) or repr(value)}: allowed are "
                         f"{'; '.join(options)}")
    return chosen


def default_strategies() -> tuple[str, ...]:
    """What the projection projects unless told (``scaling/lineup.py``)."""
    return lineup.PROJECTION


def priced(label: str, bucket_mb: Optional[float] = None, density: Optional[float] = None) -> Strategy:
    """``label``'s strategy as the model prices it, with ``bucket_mb`` and ``density`` (where set) in
    place of its preset's: the part size on every fused strategy (DDP's bucket for ``ddp``), the
    density on every sparse one; per-tensor and dense strategies ignore them. Raises ValueError."""
    options, label = strategy_options(), variants.canonical(label)  # an old label: its current one
    if label not in options:
        raise ValueError(f"unknown strategy {label!r}: allowed are {', '.join(options)}")
    chosen = dict(options[label])
    if bucket_mb is not None or density is not None:
        preset = resolve(chosen)
        if bucket_mb is not None:
            chosen["ddp_bucket_mb" if preset.fusion == "ddp" else "bucket_mb"] = bucket_mb
        if density is not None and "density" in preset.sparsifier.key_names():
            chosen["density"] = density
    return Strategy.from_plan(label, resolve(chosen))

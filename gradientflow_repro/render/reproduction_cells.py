"""How the reproduction's Markdown writes its cells: a figure over the seeds as median [range], a
verdict as met or NOT met (``render/reproduction*.py``)."""

from __future__ import annotations

import statistics
from typing import Any, Optional, Sequence


def spread(values: Sequence[Optional[float]], fmt: str, scale: float = 1.0) -> str:
    """Median [min-max] of the known values in ``fmt``, and how many are unknown (not reached)."""
    known = [v * scale for v in values if v is not None]
    if not known:
        return "not reached"
    text = f"{statistics.median(known):{fmt}}"
    if len(known) > 1:
        text += f" [{min(known):{fmt}}-{max(known):{fmt}}]"
    if len(known) < len(values):
        text += f" ({len(values) - len(known)} of {len(values)} not reached)"
    return text


def known_spread(values: Sequence[Optional[float]], fmt: str) -> str:
    """``spread`` of the known values ("-": none): for figures every finished run has, where a gap
    means a run without evaluations, not a target missed."""
    known = [v for v in values if v is not None]
    return spread(known, fmt) if known else "-"


def fmt(value: Optional[float], spec: str) -> str:
    """``value`` in ``spec``, or "not reached"."""
    return "not reached" if value is None else f"{value:{spec}}"


def said(met: bool) -> str:
    """A verdict as the report words it."""
    return "met" if met else "NOT met"


def seed_gaps(gaps: Sequence[Sequence[Any]]) -> str:
    """[seed, gap or None] pairs: "seed 0 +0.12, seed 1 -"."""
    return ", ".join(f"seed {seed} " + ("-" if gap is None else f"{gap:+.2f}") for seed, gap in gaps)

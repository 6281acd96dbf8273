"""The memory pool's packing rule, in one pure function (torch-free).

Lazy allreduce (``lazy.py``) and coarse-grained sparse communication (``csc.py``) lay their
gradients into pool parts with this rule, and the scaling model (``perfmodel.py``) prices the parts
it returns, so the two cannot drift apart:

- tensors are taken in the given order (backward order: the last layer's first) and added to the
  current part; a part is closed as soon as it holds at least ``threshold_bytes`` (at
  ``bytes_per_element`` bytes per element, 4 for the fp32 pool); the last part may be smaller;
- each part's length is padded with zeros to a whole number of ``multiple`` elements (CSC pads its
  sparse parts to whole chunks, so a part is a [chunks, chunk_size] matrix).

DDP cuts its buckets at ``bucket_cap_mb`` by the same kind of rule, so the model uses it for DDP too.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence


class Part(NamedTuple):
    """One pool part: the positions (in the given order) of the tensors it holds, and its length in
    elements after padding."""

    indices: tuple[int, ...]
    elements: int


def pack_parts(sizes: Sequence[int], threshold_bytes: float, multiple: int = 1,
               bytes_per_element: int = 4) -> list[Part]:
    """Consecutive tensors of ``sizes`` elements into parts of at least ``threshold_bytes`` (the last
    may be smaller), each part's length padded to a multiple of ``multiple`` elements."""
    if multiple < 1:
        raise ValueError(f"multiple must be at least 1, not {multiple}")
    parts: list[Part] = []
    current: list[int] = []
    filled = 0

    def close() -> None:
        elements = sum(sizes[i] for i in current)
        parts.append(Part(tuple(current), -(-elements // multiple) * multiple))

    for index, size in enumerate(sizes):
        current.append(index)
        filled += size * bytes_per_element
        if filled >= threshold_bytes:
            close()
            current, filled = [], 0
    if current:
        close()
    return parts

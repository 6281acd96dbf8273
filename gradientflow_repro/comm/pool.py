"""The memory pool's packing rule, in one pure function (torch-free).

Lazy allreduce (``lazy.py``) and coarse-grained sparse communication (``csc/``) lay their
gradients into pool parts with this rule, and the scaling model (``perfmodel.py``) prices the parts
it returns, so the two cannot drift apart:

- tensors are taken in the given order (backward order: the last layer's first) and added to the
  current part; a part is closed as soon as it holds at least ``threshold_bytes`` (at
  ``bytes_per_element`` bytes per element, 4 for the fp32 pool); the last part may be smaller;
- coarse-grained sparse communication lays each part out as its multi-dimensional tensors, padded
  to whole chunks (a [chunks, chunk_size] matrix), then its one-dimensional tensors (``csc_parts``).

DDP cuts its buckets at ``bucket_cap_mb`` by the same kind of rule, so the model uses it for DDP too.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence


class Part(NamedTuple):
    """One pool part: the positions (in the given order) of the tensors it holds, and its length in
    elements."""

    indices: tuple[int, ...]
    elements: int


def pack_parts(sizes: Sequence[int], threshold_bytes: float, bytes_per_element: int = 4) -> list[Part]:
    """Consecutive tensors of ``sizes`` elements into parts of at least ``threshold_bytes`` (the last
    may be smaller)."""
    parts: list[Part] = []
    current: list[int] = []
    filled = 0

    def close() -> None:
        parts.append(Part(tuple(current), sum(sizes[i] for i in current)))

    for index, size in enumerate(sizes):
        current.append(index)
        filled += size * bytes_per_element
        if filled >= threshold_bytes:
            close()
            current, filled = [], 0
    if current:
        close()
    return parts


class CSCPart(NamedTuple):
    """One pool part as coarse-grained sparse communication lays it out: its multi-dimensional
    tensors first, padded to whole chunks (the part's sparse section, a [chunks, chunk_size] matrix
    from which chunks are chosen), then its one-dimensional tensors (biases, BatchNorm: the dense
    tail, always sent). Chosen chunks and the dense tail travel in one payload."""

    sparse: tuple[int, ...]  # positions of the multi-dimensional tensors, in the given order
    dense: tuple[int, ...]  # positions of the one-dimensional tensors
    sparse_elements: int  # length of the sparse section, padded to whole chunks (0: none)
    dense_elements: int

    @property
    def elements(self) -> int:
        return self.sparse_elements + self.dense_elements


def csc_parts(sizes: Sequence[int], one_dimensional: Sequence[bool], threshold_bytes: float,
              chunk_elements: int) -> list[CSCPart]:
    """The pool's parts (``pack_parts`` on the tensors in the given order, so a part is ready when
    the same gradients are as in lazy allreduce), each split into its sparse section and dense tail."""
    parts = []
    for part in pack_parts(sizes, threshold_bytes):
        sparse = tuple(i for i in part.indices if not one_dimensional[i])
        dense = tuple(i for i in part.indices if one_dimensional[i])
        sparse_elements = -(-sum(sizes[i] for i in sparse) // chunk_elements) * chunk_elements
        parts.append(CSCPart(sparse, dense, sparse_elements, sum(sizes[i] for i in dense)))
    return parts

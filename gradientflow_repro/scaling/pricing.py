"""How the scaling model prices what a sparsifier sends: one rule per kind of sparsifier.

A sparsifier names its rule (``registry.Sparsifier.pricing``) and gives the rule's parameters from
its keys (``Sparsifier.parameters``). The rules, keyed by name:

- ``dense``: every gradient element, every step;
- ``chunks`` (``density``, ``chunk_size``): ceil(density x chunks) whole chunks of ``chunk_size``
  elements of each pool part's multi-dimensional tensors, its one-dimensional tensors whole, after
  one small allreduce of one norm per chunk (coarse-grained selection, no work on the optimizer's side);
- ``csc`` (as ``chunks``, and ``momentum_correction``, ``trust_noise_correction``): CSC's momentum
  correction takes over the optimizer's momentum, weight decay and adaptation, and under LARS sends
  its trust ratios' noise sketches with the norms;
- ``low_rank`` (``rank``): PowerSGD (Vogels et al. 2019): each matrix-shaped gradient (n x m) as two
  factors of rank r, P (n x r) and Q (m x r), in two allreduces per bucket; vectors whole.

A rule not known here is refused (ValueError), and so is a rule's parameter the sparsifier does not
give: a new sparsifier is never priced as if it sent every gradient. Torch-free.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

Parameters = Mapping[str, Any]


def _dense(parameters: Parameters, lars: bool) -> dict[str, Any]:
    return {"density": 1.0}


def _chunks(parameters: Parameters, lars: bool) -> dict[str, Any]:
    return {"density": parameters["density"], "chunk_elements": parameters["chunk_size"]}


def _csc(parameters: Parameters, lars: bool) -> dict[str, Any]:
    corrected = bool(parameters["momentum_correction"])
    return {**_chunks(parameters, lars), "takes_optimizer": corrected,
            "noise_sketch": lars and corrected and bool(parameters["trust_noise_correction"])}


def _low_rank(parameters: Parameters, lars: bool) -> dict[str, Any]:
    return {"low_rank": parameters["rank"]}


RULES: dict[str, Callable[[Parameters, bool], dict[str, Any]]] = {
    "dense": _dense, "chunks": _chunks, "csc": _csc, "low_rank": _low_rank}


def price(name: str, sparsifier: Any, keys: Any, lars: bool) -> dict[str, Any]:
    """The model's ``Strategy`` fields for what ``sparsifier`` (with its ``keys``) sends, for the
    strategy ``name``: ``density``, ``chunk_elements``, ``takes_optimizer``, ``noise_sketch``,
    ``low_rank`` as its rule sets them. ``lars``: the optimizer is LARS. Raises ValueError."""
    rule = RULES.get(sparsifier.pricing)
    if rule is None:
        raise ValueError(f"strategy {name!r}: sparsifier {sparsifier.name!r} has pricing rule "
                         f"{sparsifier.pricing!r}, which the model does not know (it prices {', '.join(RULES)})")
    try:
        return rule(sparsifier.parameters(keys), lars)
    except KeyError as missing:
        raise ValueError(f"strategy {name!r}: sparsifier {sparsifier.name!r} is priced by rule "
                         f"{sparsifier.pricing!r}, which needs its parameter {missing}") from None

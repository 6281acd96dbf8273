"""The registry of communication strategies: a name -> its preset (the configuration) and its builder.

A strategy is **one YAML preset** (``configs/comm/NAME.yaml``; Hydra's pattern: ``comm=NAME``) and,
where it brings code no other strategy has, **one module** that holds its algorithm and declares
its ``Sparsifier``: the dataclass of its own ``comm.*`` keys (with their checks, as every config
key has), its builder, the rule by which the scaling model prices what it sends, and the fusion it
needs. The preset names that module by its key ``module`` (a preset of a built-in sparsifier need
not: ``BUILTIN``). Nothing else is written anywhere to add a strategy: the registry finds the
presets in its preset folders (``configs/comm/`` and those listed in ``GRADIENTFLOW_COMM_PRESETS``,
separated as ``PATH`` is), and everything that reads strategies asks it.

What the registry holds is what the library needs to build a strategy: names, presets and
sparsifiers. What only the tooling reads is with the tooling, keyed by the same names: the labels of
the variants the tools compare (``gradientflow_repro/variants.py``), the benchmarks' lists
(``bench/lineup.py``), the ladder of ``make reproduce`` (``reproduction/lineup.py``), the
model's pricing rules (``scaling/pricing.py``).

Torch-free: the config check and the analytic model import it. A sparsifier's module is imported
when its name is first looked up, so it must import torch (its communicator) lazily, in its builder.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, fields, is_dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Union

from gradientflow_repro import REPO

PRESET_DIR = REPO / "configs" / "comm"
PRESET_PATH_VARIABLE = "GRADIENTFLOW_COMM_PRESETS"  # more preset folders, os.pathsep-separated


@dataclass(frozen=True)
class Sparsifier:
    """A value of ``comm.sparsity``: its own keys, what builds it, how the model prices it.

    ``keys``: a dataclass of the ``comm.*`` keys only this sparsifier reads, each declared with its
    check (``checks.setting``); None: none. ``builder``: ``fn(plan, device, sum_fn) -> Communicator``
    (``plan.Plan``; ``sum_fn``: the summing function the plan chose), as ``"module:function"``
    (imported when first built) or the function; None: the fusion's communicator (``factory``).
    ``pricing``: the scaling model's rule for what a step sends (``scaling/pricing.py``: ``dense``,
    ``chunks``, ``csc``, ``low_rank``; an unknown rule is refused there, never priced as dense) and
    ``priced_as``: the rule's parameters from the keys (default: the keys as they are).
    ``fusion``: the one ``comm.fusion`` it works over (CSC: ``lazy``; PowerSGD: ``ddp``); None: any.
    ``sends_sparse``: whether, given its keys, some steps send less than every gradient (default:
    always, once its dense warm-up is over). ``dense_steps``: steps it sends whole whatever the
    warm-up (PowerSGD's hook: 2). ``describe``: what a sparse step sends, in words, for the run's
    first lines ("density 0.1"; default: its name)."""

    name: str
    keys: Optional[type] = None
    builder: Union[str, Callable[..., Any], None] = None
    pricing: str = "dense"
    priced_as: Optional[Callable[[Any], Mapping[str, Any]]] = None
    fusion: Optional[str] = None
    sends_sparse: Callable[[Any], bool] = lambda keys: True
    dense_steps: int = 0
    describe: Optional[Callable[[Any], str]] = None

    def __post_init__(self) -> None:
        if self.keys is not None and not is_dataclass(self.keys):
            raise TypeError(f"sparsifier {self.name!r}: keys must be a dataclass of its comm.* keys")

    def in_words(self, keys: Any) -> str:
        """What a sparse step sends, in words."""
        return self.describe(keys) if self.describe is not None else self.name

    def key_names(self) -> tuple[str, ...]:
        """The ``comm.*`` keys of its own."""
        return tuple(f.name for f in fields(self.keys)) if self.keys is not None else ()

    def parameters(self, keys: Any) -> dict[str, Any]:
        """The pricing rule's parameters for ``keys`` (an instance of ``self.keys``)."""
        if self.priced_as is not None:
            return dict(self.priced_as(keys))
        return {f.name: getattr(keys, f.name) for f in fields(keys)} if keys is not None else {}


DENSE = Sparsifier("dense", sends_sparse=lambda keys: False)
# The sparsifiers this package ships: name -> the module that declares it (its ``SPARSIFIER``)
BUILTIN: dict[str, str] = {"csc": "gradientflow_repro.comm.csc", "powersgd": "gradientflow_repro.comm.powersgd"}


def preset_dirs() -> tuple[Path, ...]:
    """The folders presets are read from: ``configs/comm/``, then ``GRADIENTFLOW_COMM_PRESETS``'s."""
    extra = [Path(p) for p in os.environ.get(PRESET_PATH_VARIABLE, "").split(os.pathsep) if p]
    return (PRESET_DIR, *extra)


@lru_cache(maxsize=None)
def _read_yaml(path: Path, mtime: float) -> tuple[tuple[str, Any], ...]:
    import yaml  # here: the collective helpers import this module, and a machine with nothing but torch
    # must be able to import them (the GPU check)

    return tuple((yaml.safe_load(path.read_text()) or {}).items())


def _presets() -> dict[str, Path]:
    """Strategy name -> its preset file, the first of that name in ``preset_dirs()`` order."""
    found: dict[str, Path] = {}
    for folder in preset_dirs():
        for path in sorted(folder.glob("*.yaml")) if folder.is_dir() else ():
            found.setdefault(path.stem, path)
    return found


def names() -> tuple[str, ...]:
    """Every strategy (preset) name: the package's in their files' order, then those of other folders."""
    return tuple(_presets())


def preset(name: str) -> dict[str, Any]:
    """The keys strategy ``name``'s preset sets (``strategy`` aside). Raises ValueError for a name
    with no preset, or a YAML that names another strategy."""
    return _preset(name, _presets())


def _preset(name: str, found: dict[str, Path]) -> dict[str, Any]:
    path = found.get(name)
    if path is None:
        raise ValueError(f"config key 'comm.strategy' = {name!r}: allowed values are {', '.join(found)}")
    values = dict(_read_yaml(path, path.stat().st_mtime))
    if values.pop("strategy", None) != name:
        raise ValueError(f"{path.name}: 'strategy' must be {name!r}, the file's name")
    return values


def _declared_in(module_name: str) -> Sparsifier:
    module = importlib.import_module(module_name)
    declared = getattr(module, "SPARSIFIER", None)
    if not isinstance(declared, Sparsifier):
        raise ValueError(f"module {module_name!r} declares no SPARSIFIER (a registry.Sparsifier)")
    return declared


def sparsifiers() -> dict[str, Sparsifier]:
    """Every sparsifier: dense, the package's, and those the presets' ``module`` keys bring."""
    found = {"dense": DENSE}
    modules = [*BUILTIN.values()]
    presets = _presets()  # the folders scanned once
    for name in presets:
        module = _preset(name, presets).get("module")
        if module and module not in modules:
            modules.append(module)
    for module in modules:
        declared = _declared_in(module)
        if declared.name in found and found[declared.name] is not declared:
            raise ValueError(f"sparsifier {declared.name!r} is declared twice (module {module!r})")
        found[declared.name] = declared
    return found


def sparsifier(name: str) -> Sparsifier:
    """The sparsifier ``name`` (a value of ``comm.sparsity``). Raises ValueError naming the key."""
    if name == "dense":
        return DENSE
    if name in BUILTIN:
        return _declared_in(BUILTIN[name])
    known = sparsifiers()
    if name not in known:
        raise ValueError(f"config key 'comm.sparsity' = {name!r}: allowed values are {', '.join(known)}")
    return known[name]


def load(builder: Union[str, Callable[..., Any]]) -> Callable[..., Any]:
    """A builder given as ``"module:function"``, imported; a function as it is."""
    if callable(builder):
        return builder
    module, _, attribute = builder.partition(":")
    return getattr(importlib.import_module(module), attribute)


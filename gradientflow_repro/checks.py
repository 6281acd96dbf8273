"""What each configuration field allows, declared next to the field and checked from there.

A field of a config dataclass is declared with ``setting(default, check)``::

    density: float = setting(0.1, in_range(0, 1, low_open=True))  # csc: fraction of chunks sent

and ``field_problems(schema, cfg)`` walks the dataclasses, reads each value from ``cfg`` (the
dataclass itself or Hydra's composed DictConfig) and reports, in declaration order, every value its
check refuses as ("comm.density", 1.5, "must be in (0, 1]"). So the rule for a key lives in one
place, and a new field cannot be added without saying what it allows. Checks that involve several
keys (a batch divisible by the world size, a warm-up shorter than the run) stay in
``config.validate``. Torch-free: it runs before anything heavy is imported.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional


@dataclass(frozen=True)
class Check:
    accepts: Callable[[Any], bool]
    says: str  # what is allowed, as the error message puts it: "must be positive"

    def problem(self, value: Any) -> Optional[str]:
        try:
            return None if self.accepts(value) else self.says
        except TypeError:  # a string where a number belongs, ...
            return self.says


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


positive = Check(lambda v: _number(v) and v > 0, "must be positive")
non_negative = Check(lambda v: _number(v) and v >= 0, "must be zero or positive")
boolean = Check(lambda v: isinstance(v, bool), "must be true or false")
text = Check(lambda v: isinstance(v, str), "must be a string")
# a node of keys checked as a whole elsewhere (``comm.*``: ``plan.resolve``)
options_node = Check(lambda v: hasattr(v, "items") and all(isinstance(k, str) for k in v), "must be a mapping of keys")
config_keys = Check(lambda v: not isinstance(v, str) and all(isinstance(k, str) and k for k in v),
                    "must be a list of dotted config keys, e.g. [optim.base_lr]")


def in_range(low: float, high: float, low_open: bool = False, high_open: bool = False) -> Check:
    def accepts(v: Any) -> bool:
        return (_number(v) and (v > low if low_open else v >= low) and (v < high if high_open else v <= high))
    return Check(accepts, f"must be in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}")


def one_of(*allowed: Any) -> Check:
    return Check(lambda v: v in allowed, f"allowed values are {', '.join(map(str, allowed))}")


def optional(check: Check) -> Check:
    return Check(lambda v: v is None or check.accepts(v), f"{check.says}, or null")


def numbers(count: int, each: Check) -> Check:
    return Check(lambda v: len(v) == count and all(each.accepts(x) for x in v),
                 f"must be {count} numbers, each {each.says.removeprefix('must be ')}")


def setting(default: Any, check: Check, *, factory: Optional[Callable[[], Any]] = None) -> Any:
    """A dataclass field with its check; ``factory`` for mutable defaults (lists)."""
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata={"check": check})
    return dataclasses.field(default=default, metadata={"check": check})


def field_problems(schema: type, cfg: Any, prefix: str = "") -> Iterator[tuple[str, Any, str]]:
    """(key, value, what is allowed) for every field of ``cfg`` that its declared check refuses,
    nested dataclasses included. Fields declared without a check are errors of the schema."""
    for spec in dataclasses.fields(schema):
        key, value = prefix + spec.name, getattr(cfg, spec.name)
        nested = spec.default_factory if spec.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(nested):
            yield from field_problems(nested, value, key + ".")
            continue
        check = spec.metadata.get("check")
        if check is None:
            raise TypeError(f"config field '{key}' declares no check (use checks.setting)")
        problem = check.problem(value)
        if problem:
            yield key, value, problem

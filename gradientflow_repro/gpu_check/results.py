"""What an item is and what it reports: its result lines, and SKIP naming what is missing.

An item is a function of a ``Reporter``: it adds lines (``PASS|FAIL|SKIP  <item>[/<part>]: <detail>``),
runs its parts in ``report.part(...)`` so that one part's exception is a FAIL line of that part and
not the end of the item, and raises ``Skip`` where it cannot run here. ``need`` and
``project_imports`` turn a missing package into a SKIP that names every missing package, so that
a bare machine shows at once what to install.
"""

from __future__ import annotations

import contextlib
import importlib
import traceback
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

NO_CUDA = "no CUDA device"  # the SKIP reason of every GPU item on a machine without one
# import name -> what to install, for SKIP lines that say what is missing
PACKAGES = {"hydra": "hydra-core", "omegaconf": "omegaconf", "nvidia.dali": "DALI (nvidia-dali-cuda*)",
            "nvidia": "DALI (nvidia-dali-cuda*)", "torchvision": "torchvision", "timm": "timm",
            "matplotlib": "matplotlib", "sklearn": "scikit-learn", "PIL": "pillow", "pynvml": "nvidia-ml-py",
            "mlperf_logging": "mlperf-logging", "antlr4": "antlr4-python3-runtime", "yaml": "PyYAML"}


@dataclass(frozen=True)
class Result:
    """One line of the report."""

    status: str  # PASS | FAIL | SKIP
    item: str  # "item" or "item/part"
    detail: str  # figures or the reason

    def line(self) -> str:
        return f"{self.status}  {self.item}: {self.detail}"


class Skip(Exception):
    """Raised inside an item (or a part of one) that cannot run here; the message says why."""


def describe(error: BaseException) -> str:
    """One line for an exception (the last line of a traceback carried in its message)."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    if len(lines) > 1 and any(line.startswith("Traceback") for line in lines):
        return lines[-1][:400]
    return f"{type(error).__name__}: {' '.join(lines)[:400]}"


class Reporter:
    """An item's result lines, each handed to ``emit`` as soon as it is made."""

    def __init__(self, item: str, emit: Callable[[Result], None]) -> None:
        self.item, self.emit = item, emit
        self.results: list[Result] = []

    def add(self, status: str, detail: str, part: Optional[str] = None) -> None:
        self.add_result(Result(status, f"{self.item}/{part}" if part else self.item, detail))

    def add_result(self, result: Result) -> None:
        """A line made elsewhere (by a spawned rank), under the item name it carries."""
        self.results.append(result)
        self.emit(result)

    @contextlib.contextmanager
    def part(self, name: Optional[str] = None) -> Iterator[None]:
        """Run a block as one (sub-)item: Skip becomes a SKIP line, any other exception a FAIL."""
        try:
            yield
        except Skip as skip:
            self.add("SKIP", str(skip), name)
        except Exception as error:  # noqa: BLE001 - one item's failure must not stop the check
            traceback.print_exc()
            self.add("FAIL", describe(error), name)


@dataclass(frozen=True)
class Item:
    """A check of one thing, run as one process (its ``check`` adds the lines)."""

    name: str
    check: Callable[[Reporter], None]
    timeout_s: float  # nominal limit: the budget may give it less
    gpus: int  # CUDA devices it needs (0: runs anywhere, in this process)
    doc: str  # one line for the report's list of items
    on_test_cpu: bool = False  # runs on gloo with CPU tensors under GRADIENTFLOW_GPU_CHECK_TEST_DEVICE=cpu


def need(*modules: str) -> None:
    """Import each module, or Skip naming every package that is missing (not only the first). (A
    package that is there but fails to import for another reason is a FAIL: a broken installation.)"""
    missing = []
    for module in modules:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as error:
            missing.append(f"{PACKAGES.get(module, module)} (import {module}: {error})")
    if missing:
        raise Skip(f"needs {', '.join(missing)}")


@contextlib.contextmanager
def project_imports() -> Iterator[None]:
    """Around imports of the project's modules: a third-party module they need that is missing here
    makes the item SKIP, naming it (a missing project module stays an error)."""
    try:
        yield
    except ModuleNotFoundError as error:
        name = error.name or ""
        if not name or name.split(".")[0] == "gradientflow_repro":
            raise
        package = PACKAGES.get(name, PACKAGES.get(name.split(".")[0], name))
        raise Skip(f"needs {package}: the project's modules import {name}, which is missing") from None

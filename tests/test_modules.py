"""Every module of the library imports (the fast tier's floor: ``make test-fast`` touches each one)."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import gradientflow_repro

MODULES = sorted(info.name for info in pkgutil.walk_packages(gradientflow_repro.__path__, "gradientflow_repro.")
                 if info.name != "gradientflow_repro.gpu_check.__main__")


@pytest.mark.parametrize("name", MODULES)
def test_every_module_imports(name: str) -> None:
    importlib.import_module(name)

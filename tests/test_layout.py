"""The tree's layering: the library (trainer, comm, data, models, config) never imports the tooling
around it (reproduction, cluster, bench, scaling, gpu_check, render, and the labels the tools compare,
variants.py), so a training job carries none of it and the tooling can change without touching what
trains."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

PACKAGE = REPO / "gradientflow_repro"
TOOLING = ("reproduction", "cluster", "bench", "scaling", "gpu_check", "render", "variants")


def _is_tooling(path: Path) -> bool:
    return path.relative_to(PACKAGE).with_suffix("").parts[0] in TOOLING


def _imported_modules(path: Path) -> set[str]:
    """Every module an import statement in ``path`` names, at any depth (lazy imports too)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.level:  # relative: resolve against the importing module's package
                base = path.relative_to(REPO).with_suffix("").parts[:-node.level]
                module = ".".join([*base, node.module])
            else:
                module = node.module
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def tooling_imports(path: Path) -> list[str]:
    prefixes = tuple(f"gradientflow_repro.{package}" for package in TOOLING)
    return sorted(name for name in _imported_modules(path)
                  if name in prefixes or name.startswith(tuple(f"{p}." for p in prefixes)))


def test_the_library_never_imports_the_tooling() -> None:
    library = [path for path in PACKAGE.rglob("*.py") if not _is_tooling(path)]
    assert len(library) > 20, "the library modules were not found"
    offenders = {str(path.relative_to(REPO)): found for path in library if (found := tooling_imports(path))}
    assert not offenders, f"library modules import the tooling: {offenders}"


def test_the_check_sees_a_lazy_import(tmp_path: Path) -> None:
    """The rule reads imports anywhere in a module, inside functions too."""
    module = PACKAGE / "engine.py"
    text = module.read_text() + "\n\ndef _late():\n    from gradientflow_repro.scaling import perfmodel\n"
    probe = tmp_path / "engine.py"
    probe.write_text(text)
    assert "gradientflow_repro.scaling.perfmodel" in _imported_modules(probe)

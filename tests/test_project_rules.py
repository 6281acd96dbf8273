"""Rules of the project that CI enforces on its own text.

- README.md stays short enough to read at one sitting (the details live in docs/).
- Docstrings and comments of the code say what and why; they never carry a commit hash. A commit
  names evidence (a measurement, a result), and evidence belongs in docs/notes/ or results/, where
  it can be dated and reproduced; in the code it goes stale at the next commit.
- Every ``torch.load`` says ``weights_only=True``: a file that unpickles code never runs it.
- The library logs through ``logging`` (``gradientflow_repro/logs.py``: one formatter for the rank
  prefix, information from rank 0 only); it never calls ``print``, except in ``__main__.py`` files
  and the command-line functions listed in ``PRINTS_ALLOWED``, each with its reason.
- Every third-party package the code imports is declared in ``pyproject.toml`` (at run time, or as
  an optional extra where the code runs without it), and the LICENSE file is the license declared.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

from gradientflow_repro import REPO

README_MAX_BYTES = 15_000
CHECKED_TREES = ("gradientflow_repro", "scripts")
# A commit hash as people paste it: 7 to 40 lowercase hex digits standing alone (not the tail of a
# word, so ``0x1f2e3d4c`` or ``sha256_1a2b3c4d`` do not count), with at least one digit and at least
# one letter a-f (so plain numbers and words like ``decade`` do not count).
HEX_WORD = re.compile(r"(?<![0-9A-Za-z_])[0-9a-f]{7,40}(?![0-9A-Za-z_])")
# Words that look like a hash but are not one; each needs its reason.
NOT_HASHES: frozenset[str] = frozenset()


def commit_hashes(text: str) -> list[str]:
    """The words of ``text`` that look like a commit hash."""
    return [word for word in HEX_WORD.findall(text)
            if re.search(r"[0-9]", word) and re.search(r"[a-f]", word) and word not in NOT_HASHES]


def docstrings_and_comments(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every docstring (module, class, function) and every comment of ``path``."""
    source = path.read_text()
    found = []
    for node in ast.walk(ast.parse(source, filename=str(path))):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            docstring = ast.get_docstring(node, clean=False)
            if docstring is not None:
                found.append((node.body[0].lineno, docstring))
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            found.append((token.start[0], token.string))
    return found


def python_files() -> list[Path]:
    return sorted(path for tree in CHECKED_TREES for path in (REPO / tree).rglob("*.py"))


def test_readme_stays_under_its_size_limit() -> None:
    size = len((REPO / "README.md").read_bytes())
    assert size <= README_MAX_BYTES, (f"README.md is {size} bytes, over {README_MAX_BYTES}: move detail to "
                                      f"docs/ and link it")


def test_no_docstring_or_comment_carries_a_commit_hash() -> None:
    offences = [f"{path.relative_to(REPO)}:{line}: {', '.join(hashes)}"
                for path in python_files() for line, text in docstrings_and_comments(path)
                if (hashes := commit_hashes(text))]
    assert not offences, ("commit hashes in docstrings or comments (evidence belongs in docs/notes/ or "
                          "results/):\n" + "\n".join(offences))


@pytest.mark.parametrize(("text", "hashes"), [
    ("measured at 97760f4 on a laptop", ["97760f4"]),
    ("commit 97760f4b43f038f4a02f837713e1a759afd924d1.", ["97760f4b43f038f4a02f837713e1a759afd924d1"]),
    ("the mask 0x1f2e3d4c, 12345678 steps, a decade, deadbeef, fp16", []),
    ("abc123", []),  # too short for a commit
])
def test_a_commit_hash_is_told_from_other_words(text: str, hashes: list[str]) -> None:
    assert commit_hashes(text) == hashes


def test_docstrings_and_comments_are_both_read(tmp_path: Path) -> None:
    module = tmp_path / "module.py"
    module.write_text('"""Module at 97760f4."""\n\n\ndef f() -> str:\n    """At 1234abc."""\n'
                      '    return "not a docstring 5678def"  # but this comment: 9abc012\n')
    texts = [commit_hashes(text) for _, text in docstrings_and_comments(module)]
    assert sorted(word for words in texts for word in words) == ["1234abc", "97760f4", "9abc012"]


def torch_loads_without_weights_only(path: Path) -> list[int]:
    """The lines of ``path`` that call ``torch.load`` without ``weights_only=True``."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load" \
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch":
            safe = any(k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                       for k in node.keywords)
            if not safe:
                lines.append(node.lineno)
    return lines


def test_every_torch_load_refuses_pickled_code(tmp_path: Path) -> None:
    found = {str(path.relative_to(REPO)): lines for path in python_files()
             if (lines := torch_loads_without_weights_only(path))}
    assert found == {}, f"torch.load without weights_only=True: {found}"
    sample = tmp_path / "sample.py"
    sample.write_text("import torch\ntorch.load('a')\ntorch.load('b', weights_only=True)\n")
    assert torch_loads_without_weights_only(sample) == [2]


# The functions of the library that print, each with its reason: a command whose output on stdout
# is its product (a report, a table), or a protocol between processes; nothing else prints.
PRINTS_ALLOWED: dict[tuple[str, str], str] = {
    ("gradientflow_repro/gpu_check/runner.py", "main"):
        "the GPU check's result lines on stdout are its product (the report's own lines, compared by "
        "its tests), and a bad option is refused in one 'gpu_check: error:' line on stderr",
    ("gradientflow_repro/gpu_check/processes.py", "_emit_marked"):
        "an item's child process hands its results to the parent as marked JSON lines on stdout: a "
        "protocol read by a program, not a log read by people (and never filtered by a log level)",
    ("gradientflow_repro/render/__init__.py", "main"):
        "``python -m gradientflow_repro.render FILE.json``: the rendered Markdown on stdout is the product",
}


def prints_outside(path: Path, allowed: set[str]) -> list[int]:
    """The lines of ``path`` that call ``print`` outside the functions named in ``allowed`` (qualified
    names, ``Class.method``; what is nested in an allowed function may print too)."""
    lines: list[int] = []

    def visit(node: ast.AST, names: tuple[str, ...], inside_allowed: bool) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names = (*names, node.name)
            inside_allowed = inside_allowed or ".".join(names) in allowed
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print" \
                and not inside_allowed:
            lines.append(node.lineno)
        for child in ast.iter_child_nodes(node):
            visit(child, names, inside_allowed)

    visit(ast.parse(path.read_text(), filename=str(path)), (), False)
    return sorted(lines)


def test_the_library_logs_rather_than_prints(tmp_path: Path) -> None:
    modules = sorted(str(path.relative_to(REPO)) for path in (REPO / "gradientflow_repro").rglob("*.py")
                     if path.name != "__main__.py")
    assert {module for module, _ in PRINTS_ALLOWED} <= set(modules), "PRINTS_ALLOWED names a module that is gone"
    found = {}
    for module in modules:
        allowed = {function for where, function in PRINTS_ALLOWED if where == module}
        if lines := prints_outside(REPO / module, allowed):
            found[module] = lines
    assert found == {}, (f"print() in the library (log through logging.getLogger(__name__), see "
                         f"gradientflow_repro/logs.py): {found}")
    sample = tmp_path / "sample.py"
    sample.write_text("def main():\n    def emit(line):\n        print(line)\n    print(1)\n\n\n"
                      "class Tool:\n    def main(self):\n        print(2)\n\n\nprint(3)\n")
    assert prints_outside(sample, {"main"}) == [9, 12]
    assert prints_outside(sample, {"Tool.main"}) == [3, 4, 12]


# import name -> distribution, where they differ; and the packages the code imports only where
# present (each import guarded, the code runs without it)
DISTRIBUTIONS = {"PIL": "pillow", "hydra": "hydra-core", "sklearn": "scikit-learn", "yaml": "pyyaml",
                 "mlperf_logging": "mlperf-logging", "nvidia": "nvidia-dali-cuda130", "pynvml": "nvidia-ml-py",
                 "wandb_workspaces": "wandb-workspaces", "wds2idx": "nvidia-dali-cuda130"}
OPTIONAL_ELSEWHERE = {"apex": "NVIDIA apex is not on PyPI: built from source where wanted (docs/clusters.md)"}


def _third_party_imports() -> set[str]:
    import sys

    names = set()
    for tree in CHECKED_TREES:
        for path in (REPO / tree).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names.update(alias.name.split(".")[0] for alias in node.names)
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names.add(node.module.split(".")[0])
    return {name for name in names if name not in sys.stdlib_module_names and name != "gradientflow_repro"}


def test_every_imported_package_is_declared_and_the_license_is_there() -> None:
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = {re.split(r"[<>=!~; \[]", requirement)[0].lower()
                for requirement in [*project["dependencies"],
                                    *(r for extra in project["optional-dependencies"].values() for r in extra)]}
    missing = {name: DISTRIBUTIONS.get(name, name) for name in _third_party_imports()
               if name not in OPTIONAL_ELSEWHERE and DISTRIBUTIONS.get(name, name).lower() not in declared}
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"
    runtime = {re.split(r"[<>=!~; \[]", requirement)[0].lower() for requirement in project["dependencies"]}
    assert not runtime & {"pytest", "pytest-timeout", "ruff"}, "development tools among the runtime dependencies"
    assert project["license"] == "Apache-2.0" and "Apache License" in (REPO / "LICENSE").read_text()
    assert "Version 2.0" in (REPO / "LICENSE").read_text()


MODULE_LINES, SCRIPT_LINES = 600, 150  # past these a module or a command line does more than one thing


def oversized(root: Path) -> list[str]:
    """``path: lines`` for every library module over ``MODULE_LINES`` and script over ``SCRIPT_LINES``."""
    found = []
    for folder, limit in (("gradientflow_repro", MODULE_LINES), ("scripts", SCRIPT_LINES)):
        for path in sorted((root / folder).rglob("*.py")):
            lines = len(path.read_text().splitlines())
            if lines > limit:
                found.append(f"{path.relative_to(root)}: {lines} lines (at most {limit})")
    return found


def test_no_module_over_600_lines_and_no_script_over_150(tmp_path: Path) -> None:
    assert oversized(REPO) == []
    (tmp_path / "gradientflow_repro").mkdir()
    (tmp_path / "scripts").mkdir()
    (tmp_path / "gradientflow_repro" / "big.py").write_text("x = 1\n" * 601)
    (tmp_path / "gradientflow_repro" / "fits.py").write_text("x = 1\n" * 600)
    (tmp_path / "scripts" / "tool.py").write_text("x = 1\n" * 151)
    assert oversized(tmp_path) == ["gradientflow_repro/big.py: 601 lines (at most 600)",
                                   "scripts/tool.py: 151 lines (at most 150)"]

"""Results as data, rendered in one place.

Benchmarks and studies measure into data: a JSON document (``write_data``) with its ``kind`` and its
provenance (machine, world size, commit, command), beside any CSV of raw rows. The Markdown under
``results/`` is never written by the code that measures: it is rendered from that data here, by the
renderer the document's ``kind`` names (``"MODULE.FUNCTION"``: ``render/MODULE.py``'s ``FUNCTION``,
which takes the document and returns Markdown). Verdicts (a goal met or not) are values in the data,
decided where they are measured and checked by tests; a renderer only words them.

Where things go: a script writes under ``results/runs/NAME/`` (``output_dir``) unless asked for the
committed ``results/`` by ``--report``. ``python -m gradientflow_repro.render FILE.json ...``
re-renders Markdown from data already written.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

from gradientflow_repro import REPO

RESULTS = REPO / "results"
RUNS = RESULTS / "runs"


def output_dir(name: str, report: bool) -> Path:
    """Where a script's outputs named ``name`` go: the committed ``results/`` with ``report``, else
    ``results/runs/NAME/`` (kept out of the committed results)."""
    return RESULTS if report else RUNS / name


def shown(path: Path) -> str:
    """``path`` relative to the checkout where it is inside it (for a log line: no machine's paths)."""
    resolved = path.resolve()
    return str(resolved.relative_to(REPO) if resolved.is_relative_to(REPO) else path)


def write_data(path: Path, kind: str, data: Mapping[str, Any]) -> Path:
    """``data`` as ``path`` (.json), tagged with the renderer ``kind`` that renders it."""
    renderer(kind)  # refuse a kind nobody renders before writing anything
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {"kind": kind, **data}
    path.write_text(json.dumps(document, indent=1, default=str) + "\n")
    return path


def renderer(kind: str) -> Callable[[Mapping[str, Any]], str]:
    """The function that renders documents of ``kind`` (``"MODULE.FUNCTION"``). Raises ValueError."""
    module, _, function = kind.partition(".")
    try:
        return getattr(importlib.import_module(f"{__name__}.{module}"), function)
    except (ImportError, AttributeError):
        raise ValueError(f"no renderer for results of kind {kind!r} (gradientflow_repro/render/)") from None


def render(document: Mapping[str, Any]) -> str:
    """``document``'s Markdown, by the renderer its ``kind`` names."""
    return renderer(document["kind"])(document)


def render_file(data: Path, markdown: Optional[Path] = None) -> Path:
    """Render ``data`` (.json) to ``markdown`` (default: beside it, .md). Returns the Markdown's path."""
    markdown = markdown or data.with_suffix(".md")
    markdown.write_text(render(json.loads(data.read_text())))
    return markdown


def table(header: Sequence[str], rows: Iterable[Sequence[Any]], align: Optional[str] = None) -> str:
    """A Markdown table. ``align``: one character per column, ``l`` or ``r`` (default: all left)."""
    align = align or "l" * len(header)
    rule = ["---:" if a == "r" else "---" for a in align]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(rule) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def size(nbytes: float) -> str:
    """A byte count as people read it: 16 MiB, 64 KiB, 4 B."""
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes:g} B"


def provenance_line(facts: Mapping[str, Any]) -> str:
    """One line naming what produced a document: machine, world size, commit, command."""
    parts = [f"{key}: {facts[key]}" for key in ("machine", "world", "commit", "command") if facts.get(key)]
    return "; ".join(parts)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m gradientflow_repro.render FILE.json ...``: each file's Markdown beside it."""
    paths = [Path(arg) for arg in (sys.argv[1:] if argv is None else argv)]
    if not paths:
        print("usage: python -m gradientflow_repro.render FILE.json ...", file=sys.stderr)
        return 2
    for path in paths:
        print(render_file(path))
    return 0

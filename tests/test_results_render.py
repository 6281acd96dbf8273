"""Every committed result that has its data is the rendering of that data.

A document of ``results/`` with a ``kind`` (``render.write_data``) renders, through the renderer its
kind names, to exactly the Markdown committed beside it: the tables under ``results/`` are written
in one place, from numbers a reader can load, and a hand edit of either side shows here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gradientflow_repro import render

from conftest import REPO

DOCUMENTS = sorted(path for path in (REPO / "results").glob("*.json") if "kind" in json.loads(path.read_text()))


def test_the_rendered_results_are_there() -> None:
    assert {"REPORT", "scaling", "model_check", "allreduce", "cluster_comm"} <= {p.stem for p in DOCUMENTS}


@pytest.mark.parametrize("data", DOCUMENTS, ids=[p.stem for p in DOCUMENTS])
def test_a_committed_result_is_the_rendering_of_its_data(data: Path) -> None:
    markdown = data.with_suffix(".md")
    assert markdown.is_file(), f"{markdown.name} is missing beside {data.name}"
    assert render.render(json.loads(data.read_text())) == markdown.read_text(), (
        f"results/{markdown.name} is not what results/{data.name} renders to: "
        f"python -m gradientflow_repro.render results/{data.name}")


def test_a_kind_nobody_renders_is_refused() -> None:
    with pytest.raises(ValueError, match="no renderer for results of kind 'nothing.here'"):
        render.render({"kind": "nothing.here"})

#!/usr/bin/env python3
"""The scaling model against published results -> results/runs/model_check/ (--report: results/model_check)

Fits the model's free parameters (link efficiency per fabric, the overlap slowdown, the per-step
overhead per framework: ``gradientflow_repro/scaling/calibration.py``) on the rows of
``gradientflow_repro/scaling/published.py`` marked fitted, and checks every row: reported,
predicted, error in points, fitted or test, and the command that projects it. Then the paper's
projection as a band over its unknowns, its time to train, and the backward readiness by FLOPs
against a per-layer profile measured on this machine's CPU. Written as data (.json) and Markdown
rendered from it (.md); the committed .json is the calibration that scripts/simulate_scaling.py
projects with by default.

    python scripts/model_check.py [--report | --out PATH] [--no-measure]

The logic: gradientflow_repro/scaling/published_check.py.
"""

from __future__ import annotations

import shlex
import sys
from typing import Optional

from gradientflow_repro import logs
from gradientflow_repro.scaling import published_check
from gradientflow_repro.scaling.published_check import cli_command  # noqa: F401 - each row's command, for tests


def main(argv: Optional[list[str]] = None) -> None:
    logs.configure("model_check")
    args = sys.argv[1:] if argv is None else argv
    published_check.main(args, "python scripts/model_check.py" + "".join(f" {shlex.quote(a)}" for a in args))


if __name__ == "__main__":
    main()

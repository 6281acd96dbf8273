#!/usr/bin/env python3
"""The GPU check: is this project's CUDA path sound on this machine? -> the report named by --out

One line per item, ``PASS|FAIL|SKIP  <item>: <figures or reason>``, each item with its share of a
3-minute budget; exit status 1 if any item failed, 2 for bad options (refused before anything
runs). Items whose packages (DALI, hydra-core, ...) or GPUs are missing are SKIP, naming them. What
each item checks and what a bare machine needs: ``gradientflow_repro/gpu_check/items.py``.

    python3 -m gradientflow_repro.gpu_check --out DIR/gpu_check.md   # the command: from the repo root,
                                                                     # needs only torch (and timm)
    make gpu-check GPU_CHECK_OUT=DIR/gpu_check.md    # the same; installs nothing (the venv's python, else python3)
    python scripts/gpu_check.py [--out FILE | --report] [--only nccl_2gpu nccl_1rank ...] [--strict]

Without ``--out`` the report goes to results/runs/gpu_check/gpu_check.md in the checkout (the log beside
it); ``--report`` writes the committed results/gpu_check.md.
"""

from __future__ import annotations

import sys

try:
    from gradientflow_repro.gpu_check import main
except ModuleNotFoundError as error:
    if error.name != "gradientflow_repro":
        raise
    sys.exit("error: the gradientflow_repro package is not installed here: run `python3 -m "
             "gradientflow_repro.gpu_check` from the repository root (needs only torch), or `pip install -e .`")

if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""The GPU check: is this project's CUDA path sound on this machine? -> results/gpu_check.md

One line per item, ``PASS|FAIL|SKIP  <item>: <figures or reason>``, each item with its own time
limit (under 8 minutes in all on one GPU); exit status 1 if any item failed. Items whose packages
(DALI, hydra-core, ...) or GPUs are missing are SKIP. What each item checks:
``gradientflow_repro/gpu_check.py``.

    make gpu-check                                   # in the project's venv
    python scripts/gpu_check.py [--out FILE] [--only nccl_1rank comm_gloo_cuda ...]   # package installed
    python3 -m gradientflow_repro.gpu_check [...]    # from the repo root on a bare machine: needs only torch
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

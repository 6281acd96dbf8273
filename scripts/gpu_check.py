#!/usr/bin/env python3
"""The GPU check: is this project's CUDA path sound on this machine? -> results/gpu_check.md

One line per item, ``PASS|FAIL|SKIP  <item>: <figures or reason>``, each item with its own time
limit (under 8 minutes in all on one GPU); exit status 1 if any item failed. Needs only torch:
items whose packages (DALI, hydra-core, ...) or GPUs are missing are SKIP. What each item checks:
``gradientflow_repro/gpu_check.py``.

    make gpu-check                                   # in the project's venv
    python3 scripts/gpu_check.py [--out FILE] [--only nccl_1rank comm_gloo_cuda ...]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs without installing the package

from gradientflow_repro.gpu_check import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

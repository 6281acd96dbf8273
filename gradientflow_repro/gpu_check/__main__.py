"""``python -m gradientflow_repro.gpu_check``: the GPU check's command line."""

import sys

from gradientflow_repro.gpu_check import main

sys.exit(main())

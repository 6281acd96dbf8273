"""The GPU check: one prepared command that says whether this project's CUDA path works on a machine.

The test suite runs on CPUs with gloo; what only a GPU machine can show is collected here, to run
in one go within a budget (3 minutes by default, however many GPUs) as one command, from the
repository root, on a machine with nothing but torch (and timm) as on one with everything::

    python3 -m gradientflow_repro.gpu_check --out DIR/gpu_check.md [--only ITEM ...] [--budget-s S] [--strict]

``make gpu-check GPU_CHECK_OUT=DIR/gpu_check.md`` runs the same and installs nothing: the project's
venv where there is one, else the machine's ``python3`` (``PYTHON=...`` names another).

(``scripts/gpu_check.py`` takes the same options.) The items, in the order they run, and what each
needs beyond torch: ``items.py``.

What it says. Each item prints lines ``PASS|FAIL|SKIP  <item>: <figures or reason>`` (``<item>/<part>``
for a part of one):

- PASS: it ran, and what it checks held (the figures say by how much);
- FAIL: it ran and a result was wrong, or it raised, hung past its time limit or its process died;
- SKIP: it could not run here; the line names what was missing (a GPU, a package, the budget).

All lines and a header (date, host, GPUs, versions, commit, command) go to ``--out`` (by default
``results/runs/gpu_check/gpu_check.md`` in the checkout, ``--report`` the committed
``results/gpu_check.md``; on a machine whose runner brings back only an output folder, name a file
in it), rewritten before every item so that a check cut short still leaves its
file; every child process's full output goes to the ``.log`` beside it.

Exit status: 0 when no line is FAIL; 1 if any line is FAIL (with ``--strict`` also if any is SKIP);
2 for bad options (an ``--out`` that is a directory or cannot be written, an unknown item, a budget
too small, a bad test hook), refused in one line before any item runs; 130 when interrupted.

The modules:

    items.py          the items in the order they run, their nominal limits, what a bare machine needs
    environment.py    what the machine has (torch, CUDA, NCCL, driver, GPUs): the item environment
    collectives.py    nccl_1rank, nccl_2gpu: NCCL's collectives, and ours and the lazy pool against them
    communicators.py  comm_gloo_cuda: every communicator on CUDA tensors against the mean gradient
    training.py       throughput, trainer_fp16: the fp16 step's images/s, the trainer end to end
    dali.py           dali: DALI's GPU and CPU pipelines over one epoch of the digits
    results.py        what an item is and reports (Item, Reporter, Result, Skip), SKIP naming packages
    devices.py        the device an item runs on, timing on it
    processes.py      each item in a child process of its own with a time limit; spawned ranks
    runner.py         the command line: options, the budget over the items, the report, exit status
    hooks.py          test-only hooks: the suite runs the check on CPUs and injects faults it must FAIL

Importing the package imports only the standard library, torch and ``cluster.world`` (standard
library only); the project's other modules and optional packages (Hydra, DALI, timm, ...) are
imported inside the items that use them, so that a machine with nothing but torch runs the check
(the test suite runs every item so, on the CPU, with Hydra, OmegaConf, wandb, DALI and matplotlib
made unimportable).
"""

from gradientflow_repro.gpu_check.communicators import COMM_CASES, PARITY_CASES, check_communicators_on_cpu
from gradientflow_repro.gpu_check.environment import gpu_environment
from gradientflow_repro.gpu_check.hooks import TEST_DEVICE_ENV, TEST_FAULT_ENV
from gradientflow_repro.gpu_check.items import ITEM_BY_NAME, ITEMS
from gradientflow_repro.gpu_check.processes import child_main, run_here, run_in_child
from gradientflow_repro.gpu_check.results import Item, Reporter, Result, Skip
from gradientflow_repro.gpu_check.runner import BUDGET_S, item_limit, main
from gradientflow_repro.gpu_check.training import PAPER_ALEXNET_IMAGES_PER_S, throughput_verdict

__all__ = ["BUDGET_S", "COMM_CASES", "ITEMS", "ITEM_BY_NAME", "Item", "PAPER_ALEXNET_IMAGES_PER_S", "PARITY_CASES",
           "Reporter", "Result", "Skip", "TEST_DEVICE_ENV", "TEST_FAULT_ENV", "check_communicators_on_cpu",
           "child_main", "gpu_environment", "item_limit", "main", "run_here", "run_in_child", "throughput_verdict"]

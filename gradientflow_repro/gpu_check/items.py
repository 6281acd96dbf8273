"""The items of the GPU check, in the order they run, with their nominal time limits.

The multi-GPU item runs first, so that a check cut short by its budget has run NCCL across GPUs;
then what needs only torch; then what needs the trainer's packages:

    environment     torch, CUDA, NCCL and driver versions, GPUs and their compute capability (each
                    must be in torch's arch list), DALI and the optional packages (environment.py)
    nccl_2gpu       one NCCL rank per GPU on two GPUs: our ring and hierarchical sums, the trainer's
                    collective helpers and lazy allreduce against NCCL's; no stray context on GPU 0
                    (collectives.py)
    nccl_1rank      an NCCL process group of one rank: every collective the trainer's helpers send,
                    really sent, each result checked, us per call; the lazy pool and CSC sending
                    through it from the pool's thread and side stream, against dist.all_reduce
                    (collectives.py)
    comm_gloo_cuda  every communicator on CUDA tensors in two gloo ranks sharing GPU 0, against the
                    mean of the ranks' own gradients; the full stack under timm's Lars against the
                    same run on the CPU (communicators.py)
    throughput      per step of the project's fp16 step on AlexNet-BN, NCHW and channels_last:
                    images/s against the bar for the GPU found, kernel launches, host syncs, peak
                    memory; ResNet-50's images/s; CSC's local work alone and beside the step (the
                    scaling model's local_work_slowdown); host syncs per step of the trainer
                    (training.py)
    trainer_fp16    the trainer end to end through torchrun on CUDA with fp16, per strategy, and
                    resumed (training.py)
    dali            DALI's GPU (nvJPEG, ``mixed``) and CPU pipelines over one epoch of the digits
                    (dali.py)

To add an item: write a function of a ``Reporter`` (``results.py``) in the module of its topic,
importing what it needs beyond torch inside the function, and add an ``Item`` here with the GPUs
it needs and a nominal limit (the budget's shares follow from the limits: ``runner.item_limit``).

What a bare machine needs. Only the standard library, torch and ``cluster.world.free_port``
(standard library only) are imported at module level; the project's other modules and optional
packages are imported inside the items that use them, and a missing one makes its item (or part)
SKIP, naming every missing package. ``environment``, ``nccl_1rank``'s collectives and the trainer's
helpers, and ``throughput``'s AlexNet-BN figures and CSC's local work need only torch, plus numpy
for torch's own object collectives (``all_gather_object``). What builds a communicator (``nccl_2gpu``,
``nccl_1rank``'s pool, ``comm_gloo_cuda``) also needs PyYAML (the presets of ``configs/comm/``) and
timm (the Lars optimizer), which a machine with timm has (timm brings PyYAML, numpy and
torchvision; ResNet-50 needs torchvision). So on a machine with torch and timm only, every item
runs but these, which SKIP naming what they lack: ``dali`` (DALI), ``throughput``'s host syncs of
the trainer and ``trainer_fp16`` (the trainer's packages, below).

The trainer needs Hydra and what it imports with ``logger=jsonl data=synthetic``, which is neither
wandb nor DALI: hydra-core, omegaconf, antlr4-python3-runtime (4.9.x), PyYAML, timm and
mlperf-logging (only its ``mllog`` module: install it with ``--no-deps``, which leaves out pandas
and scipy). A run of it (``trainer_fp16``) also needs matplotlib (the trainer draws its top-1 plot
when a run ends, ``tracking.plot_top1``; not a small wheel: it brings compiled dependencies of its
own); its step (``throughput``'s host syncs) does not. Offline, bring the four small wheels (pure
Python, under 1 MB together; ``pip wheel`` builds one where only a source archive is published)
and install them without an index::

    pip wheel --no-deps -w wheels hydra-core==1.3.8 omegaconf==2.3.1 \\
        antlr4-python3-runtime==4.9.3 mlperf-logging==4.1.68      # on a machine with internet
    pip install --no-index --no-deps wheels/*.whl               # on the GPU machine

Time: the nominal limits below are each item's most on one GPU; the budget (``runner.BUDGET_S``,
3 minutes) caps the sum whatever the GPU count, each item getting its share of what is left.
"""

from __future__ import annotations

from gradientflow_repro.gpu_check.collectives import check_nccl_single_rank, check_two_gpus
from gradientflow_repro.gpu_check.communicators import check_communicators
from gradientflow_repro.gpu_check.dali import check_dali
from gradientflow_repro.gpu_check.environment import check_environment
from gradientflow_repro.gpu_check.results import Item
from gradientflow_repro.gpu_check.training import check_throughput, check_trainer

# In the order they run: what needs several GPUs first (a check cut short has crossed GPUs), then
# what needs only torch, then what needs the trainer's packages. Nominal limits sum to the budget
# on one GPU; each item's limit is its share of what is left (``item_limit``).
ITEMS = [
    Item("environment", check_environment, 60, 0, "versions, GPUs and their arch, DALI, optional packages"),
    Item("nccl_2gpu", check_two_gpus, 40, 2, "ring, hierarchical and the trainer's helpers vs NCCL on 2 GPUs; "
         "lazy vs dist.all_reduce of the reference; no stray context on GPU 0", on_test_cpu=True),
    Item("nccl_1rank", check_nccl_single_rank, 25, 1,
         "every collective the trainer's helpers send, through NCCL at world size 1, results checked (us/call); "
         "the lazy pool and CSC sending through it from the pool's thread and stream, vs dist.all_reduce",
         on_test_cpu=True),
    Item("comm_gloo_cuda", check_communicators, 40, 1,
         "every communicator on CUDA tensors, 2 gloo ranks on GPU 0, against the mean gradient", on_test_cpu=True),
    Item("throughput", check_throughput, 45, 1, "AlexNet-BN fp16 NCHW and channels_last: images/s against the "
         "bar for this GPU, kernel launches, host syncs, peak memory per step; ResNet-50; CSC's local work "
         "alone and beside the step; the trainer's host syncs per step", on_test_cpu=True),
    Item("trainer_fp16", check_trainer, 50, 1, "torchrun + fp16 on CUDA (allreduce, lazy, gradientflow), "
         "gradientflow resumed"),
    Item("dali", check_dali, 20, 1, "DALI mixed (GPU) and CPU pipelines over one epoch of the digits"),
]
ITEM_BY_NAME = {item.name: item for item in ITEMS}

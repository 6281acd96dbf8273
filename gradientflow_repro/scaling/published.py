"""Published data-parallel scaling results, as the scaling model (``perfmodel``) sees their setups.

Each ``Published`` row names the setup (model, images per GPU, the single-GPU throughput the source
gives, GPUs, GPUs per node, the fabric between nodes and inside them, the strategy the system ran
as a registered label), the source, the reported efficiency or speedup, and whether the row is in
the subset that ``scaling/calibration.py`` fits (``fitted``) or one that tests the fit.

Efficiency is E(N) = T(N) / (N T(1)) for throughput T; where the source's base is more than one GPU
(Goyal et al.: 8), E = (T(N) / T(base)) / (N / base). Where a source gives only a speedup (the
paper's two claims), ``reported_speedup`` carries it and the goal is 15% of it.

How a baseline system is modelled, by what it ran:
- Horovod 2017 (README tables, 16/64 GPUs; charts at 128/512): fp32 gradients, NCCL's flat ring,
  Tensor Fusion buffers sent as backward produces them: a DDP-like bucketed builtin strategy
  (``variants.DDP_STYLE``) on NCCL;
- TensorFlow's ``replicated`` variable update with NCCL (the DGX-1 benchmarks): one NCCL allreduce
  per variable, started as its gradient is ready in the dataflow graph, so per tensor with overlap
  (``PER_TENSOR_OVERLAP``);
- Caffe2 + Gloo (Goyal et al.): allreduce per parameter blob overlapped with backward, fp32;
- PyTorch DDP (DeepLearningExamples): 25 MB buckets overlapped, fp32 gradients (AMP keeps them fp32);
- the paper's open-source baseline (2.5x at 64 GPUs, "popular open-source DNN systems"): not
  named; modelled as per-tensor allreduce after backward (``allreduce``), the most naive reading;
- the paper's own system: the full stack (``gradientflow``).

Assumed where a source is silent (each row's ``note``): the intra-node rate (PCIe 3.0 x16, 10 GB/s,
for 4-GPU "Pascal" servers), per-message latency (10 us with RDMA, 30 us over TCP), and that
Horovod's 128- and 512-GPU charts ran at Table A's single-GPU throughput on the same fabric.
Torch-free: a table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from gradientflow_repro import variants

# The fabrics between nodes (``Published.fabric``); the link efficiency of each is fitted or set
# from the NCCL maintainers' figures (``calibration``)
FABRICS = {
    "roce25": "25 Gbit/s RoCE, RDMA (Horovod 2017)",
    "tcp25": "25 Gbit/s Ethernet, TCP (Horovod 2017)",
    "tcp40": "40 Gbit/s Ethernet, TCP (Horovod 2017)",
    "eth50": "50 Gbit/s Ethernet, Gloo over TCP/RoCE (Goyal et al. 2017)",
    "ib56": "56 Gbit/s FDR InfiniBand (the paper)",
    "none": "one node: nothing between nodes",
}
# Inside a node (``Published.intra``): nominal GB/s per direction that a ring sees, with where it comes
# from (none of these is in the sources the table cites: all assumed, and fitted where a row measures it)
INTRA_NODE = {
    "pcie3": (10.0, "PCIe 3.0 x16, ~10 GB/s achieved of 16 nominal (assumed for 4-GPU Pascal servers)"),
    "nvlink-p100": (20.0, "DGX-1 P100 hybrid cube-mesh: NCCL rings over one 20 GB/s NVLink per hop (assumed)"),
    "nvlink-v100": (40.0, "DGX-1V V100 hybrid cube-mesh: ~40 GB/s ring bus bandwidth (assumed)"),
    "nvswitch-a100": (230.0, "DGX A100 NVSwitch: ~230 GB/s all-reduce bus bandwidth (assumed)"),
    "nvswitch-v100": (120.0, "DGX-2 NVSwitch (V100): ~120 GB/s all-reduce bus bandwidth (assumed)"),
}
# per tensor, overlapped: the pool of 1 MB parts of builtin allreduces, overlapped (a
# tensor over 1 MB goes alone; the small ones, under 1% of the bytes, are packed)
PER_TENSOR_OVERLAP = variants.PER_TENSOR_OVERLAPPED


@dataclass(frozen=True)
class Published:
    """One published scaling result and its setup."""

    name: str
    source: str  # where the number is written (section of the compiled table it comes from)
    model: str  # a torchvision or our model name (``profile.build_named_model``)
    image_size: int
    images_per_gpu: int
    single_gpu_images_s: float  # the source's own single-GPU throughput (or the stated assumption)
    gpus: int
    gpus_per_node: int
    fabric: str  # a key of FABRICS
    link_gbps: float  # nominal, between nodes
    intra: str  # a key of INTRA_NODE
    strategy: str  # a registered label, or PER_TENSOR_OVERLAP
    framework: str  # whose per-step overhead applies (``calibration``)
    reported_efficiency: Optional[float] = None
    reported_speedup: Optional[float] = None
    base_gpus: int = 1
    fitted: bool = False
    latency_us: float = 10.0
    confidence: str = "H"  # H: the source's own table or text; M: a secondary source; L: memory
    # NCCL's ring alone (NCCL_ALGO=Ring): the systems of 2017 ran a flat NCCL ring (NCCL's tree came later)
    ring_only: bool = False
    note: str = ""

    @property
    def reported(self) -> float:
        """The reported efficiency, or the speedup's (speedup / GPUs, relative to ``base_gpus``)."""
        if self.reported_efficiency is not None:
            return self.reported_efficiency
        assert self.reported_speedup is not None
        return self.reported_speedup / (self.gpus / self.base_gpus)


_HVD_A = {"inception_v3": 134.4, "resnet101": 119.4, "vgg16": 130.9}  # Table A, one GPU, batch 64
_HVD_B = {"inception_v3": 148.8, "resnet101": 136.0, "vgg16": 149.6}  # Table B, one GPU, batch 64
_SIZE = {"inception_v3": 299, "resnet101": 224, "vgg16": 224, "alexnet": 224, "resnet50": 224}
_README_A = "Horovod README f7eb2177 Table A (16 GPUs, 25G RoCE)"
_README_B = "Horovod README f7eb2177 Table B (64 GPUs, 40G TCP)"


def _horovod(model: str, gpus: int, fabric: str, gbps: float, efficiency: float, source: str, fitted: bool,
             single: dict[str, float], latency_us: float, note: str = "") -> Published:
    return Published(f"Horovod 2017 {model} {gpus} GPUs {fabric}", source, model, _SIZE[model], 64, single[model],
                     gpus, 4, fabric, gbps, "pcie3", variants.DDP_STYLE, "horovod", reported_efficiency=efficiency,
                     fitted=fitted, latency_us=latency_us, ring_only=True, note=note)


CHART = "single-GPU throughput of Table A (the chart gives none); batch 64 assumed"

ROWS: tuple[Published, ...] = (
    # fitted: Horovod's 16- and 64-GPU tables (images/s on one and N GPUs, known fabric)
    _horovod("inception_v3", 16, "roce25", 25, 2022.6 / (16 * 134.4), _README_A + ", RDMA+NCCL", True, _HVD_A, 10),
    _horovod("resnet101", 16, "roce25", 25, 1746.2 / (16 * 119.4), _README_A + ", RDMA+NCCL", True, _HVD_A, 10),
    _horovod("vgg16", 16, "roce25", 25, 1787.4 / (16 * 130.9), _README_A + ", RDMA+NCCL", True, _HVD_A, 10),
    _horovod("inception_v3", 16, "tcp25", 25, 1990.7 / (16 * 134.4), _README_A + ", TCP+NCCL", True, _HVD_A, 30),
    _horovod("resnet101", 16, "tcp25", 25, 1685.1 / (16 * 119.4), _README_A + ", TCP+NCCL", True, _HVD_A, 30),
    _horovod("vgg16", 16, "tcp25", 25, 1308.7 / (16 * 130.9), _README_A + ", TCP+NCCL", True, _HVD_A, 30),
    _horovod("inception_v3", 64, "tcp40", 40, 7932.1 / (64 * 148.8), _README_B + ", TCP+NCCL", True, _HVD_B, 30),
    _horovod("resnet101", 64, "tcp40", 40, 7741.6 / (64 * 136.0), _README_B + ", TCP+NCCL", True, _HVD_B, 30),
    _horovod("vgg16", 64, "tcp40", 40, 6084.2 / (64 * 149.6), _README_B + ", TCP+NCCL", True, _HVD_B, 30),
    # test: Horovod's charts at 128 and 512 GPUs on the same 25G RoCE fabric
    _horovod("inception_v3", 128, "roce25", 25, 0.90, "Horovod docs 128-GPU chart (Oct 2017 - May 2018)", False,
             _HVD_A, 10, CHART),
    _horovod("resnet101", 128, "roce25", 25, 0.90, "Horovod docs 128-GPU chart (Oct 2017 - May 2018)", False,
             _HVD_A, 10, CHART),
    _horovod("vgg16", 128, "roce25", 25, 0.79, "Horovod docs 128-GPU chart (Oct 2017 - May 2018)", False,
             _HVD_A, 10, CHART),
    _horovod("inception_v3", 512, "roce25", 25, 0.90, "Horovod docs/benchmarks.rst 512-GPU chart (2018)", False,
             _HVD_A, 10, CHART),
    _horovod("resnet101", 512, "roce25", 25, 0.90, "Horovod docs/benchmarks.rst 512-GPU chart (2018)", False,
             _HVD_A, 10, CHART),
    _horovod("vgg16", 512, "roce25", 25, 0.68, "Horovod docs/benchmarks.rst 512-GPU chart (2018)", False,
             _HVD_A, 10, CHART),
    # TF benchmarks, one DGX-1 (P100, NVLink), replicated with NCCL: 2 and 4 GPUs fitted, 8 tested
    *(Published(f"TF benchmarks DGX-1 {model} {n} GPUs", "TF benchmarks (May 2017), DGX-1 synthetic", model, 224,
                batch, single, n, 8, "none", 0.0, "nvlink-p100", PER_TENSOR_OVERLAP, "tf-replicated",
                reported_efficiency=images / (n * single), fitted=n < 8, ring_only=True)
      for model, batch, single, by_n in (("alexnet", 512, 2987, {2: 5658, 4: 10509, 8: 17822}),
                                         ("vgg16", 64, 154, {2: 295, 4: 584, 8: 1081}))
      for n, images in by_n.items()),
    # test: Goyal et al. 2017, ResNet-50 8 -> 256 P100 (8 per Big Basin server, NVLink), 50 GbE
    Published("Goyal 2017 ResNet-50 256 GPUs", "Goyal et al. 2017 abstract (~90%, 8 -> 256 GPUs)", "resnet50", 224,
              32, 195.0, 256, 8, "eth50", 50, "nvlink-p100", PER_TENSOR_OVERLAP, "caffe2",
              reported_efficiency=0.90, base_gpus=8, latency_us=10,
              note="single GPU 195 images/s: TF's P100 ResNet-50 at batch 32 (Goyal give none); "
                   "halving-doubling priced as NCCL's ring"),
    # DeepLearningExamples, ResNet-50 v1.5, PyTorch DDP on one node (fp32 gradients): PyTorch DDP's
    # per-step overhead fitted on the row where a per-step cost weighs most (the shortest step, DGX A100
    # AMP, 256 / 2,470 s), the other three test it (steps 1.1 to 2.9 times as long)
    *(Published(f"DLE PyTorch {system} {precision}", "NVIDIA DeepLearningExamples ResNet-50 v1.5 PyTorch README",
                "resnet50", 224, batch, single, 8, 8, "none", 0.0, intra, "ddp", "pytorch-ddp",
                reported_efficiency=images / (8 * single), fitted=(system, precision) == ("DGX A100 80GB", "AMP"),
                note="AMP: fp32 gradients on the wire (native AMP)")
      for system, precision, batch, single, images, intra in (
          ("DGX-1V 16GB", "FP32", 112, 367, 2855, "nvlink-v100"),
          ("DGX-1V 16GB", "AMP", 256, 1200, 8322, "nvlink-v100"),
          ("DGX A100 80GB", "TF32", 256, 938, 7248, "nvswitch-a100"),
          ("DGX A100 80GB", "AMP", 256, 2470, 16621, "nvswitch-a100"))),
    # test: DeepLearningExamples, ResNet-50 v1.5, TensorFlow with Horovod on one node (fp32 gradients)
    *(Published(f"DLE TensorFlow {system} {precision}", "NVIDIA DeepLearningExamples ResNet-50 v1.5 TensorFlow "
                "README", "resnet50", 224, batch, single, gpus, gpus, "none", 0.0, intra, variants.DDP_STYLE,
                "horovod", reported_efficiency=images / (gpus * single), confidence="H",
                note="Horovod (secondary); fp32 gradients; averaged over an epoch (data pipeline included)")
      for system, precision, batch, single, gpus, images, intra in (
          ("DGX A100 40GB", "TF32", 256, 909, 8, 7000, "nvswitch-a100"),
          ("DGX A100 40GB", "AMP", 256, 2375, 8, 17400, "nvswitch-a100"),
          ("DGX-1V 16GB", "FP32", 128, 412, 8, 3170, "nvlink-v100"),
          ("DGX-1V 16GB", "AMP", 256, 1270, 8, 9510, "nvlink-v100"),
          ("DGX-2", "FP32", 128, 432, 16, 6500, "nvswitch-v100"),
          ("DGX-2", "AMP", 256, 1300, 16, 17250, "nvswitch-v100"))),
    # the paper's two claims (speedups; setup partly unknown: 8 GPUs per node, PCIe and the single-GPU
    # throughput its own abstract implies are the projection's assumptions)
    Published("the paper: GradientFlow 512 GPUs", "Sun et al. 2019 abstract (410.2x)", "alexnet_bn", 224, 128,
              3297.0, 512, 8, "ib56", 56, "pcie3", "gradientflow", "gradientflow", reported_speedup=410.2,
              confidence="H", note="GPUs per node, GPU, batch not stated: projection's assumptions"),
    Published("the paper: open-source baseline 64 GPUs", "Sun et al. 2019 abstract (2.5x)", "alexnet_bn", 224, 128,
              3297.0, 64, 8, "ib56", 56, "pcie3", "allreduce", "open-source", reported_speedup=2.5,
              note="system not named: per-tensor allreduce after backward assumed"),
)

"""The paper's setting (Sun et al., arXiv 1902.06855) as the scaling model's inputs: each value with
its source, "derived" values following from the paper's own abstract, "assumed" where it is silent
(their effect: the sensitivity table of ``results/scaling.md``)."""

from __future__ import annotations

from dataclasses import replace

from gradientflow_repro.scaling.network import Network
from gradientflow_repro.scaling.workload import ModelProfile, uniform_profile

# Each value with its source; "derived" values follow from the paper's own abstract.
IMAGENET_TRAIN = 1_281_167  # ILSVRC-2012 training images
PAPER_GPUS, PAPER_SPEEDUP, PAPER_MINUTES, PAPER_EPOCHS = 512, 410.2, 1.5, 95  # abstract
PAPER_BASELINE_GPUS, PAPER_BASELINE_SPEEDUP = 64, 2.5  # abstract: "popular open-source systems"
PAPER_LINK_GBPS = 56  # abstract
PAPER_PER_GPU_BATCH = 128  # ours: 65,536 / 512 (Jia et al. 2018 trained AlexNet at 64K)
# derived: 95 epochs in 90 s on 512 GPUs is 1.35M images/s; with speedup 410.2 one GPU runs at
# 1.35M / 410.2 = 3,300 images/s (the paper's own single-GPU throughput, whatever its GPU)
PAPER_SINGLE_GPU_IMAGES_S = IMAGENET_TRAIN * PAPER_EPOCHS / (PAPER_MINUTES * 60) / PAPER_SPEEDUP
ASSUMED_GPUS_PER_NODE = 8  # assumption: the common 8-GPU server (the paper's is not known to us)
ASSUMED_LATENCY_S = 10e-6  # assumption: per message of a ring step over InfiniBand with NCCL/MPI
ASSUMED_INTRA_NODE_BPS = 10e9  # assumption: PCIe 3.0 x16 between GPUs of a node (no NVLink)
ASSUMED_BACKWARD_SHARE = 2 / 3  # assumption: backward takes twice the forward's time (the by-size stand-in)
# The local work of CSC and of the fp16 wire on a GPU is memory-bound: priced as the bytes it moves
# over the GPU's memory bandwidth. Assumed: a V100 (the paper's GPU by our unverified recollection)
# streams about 800 GB/s in practice (BabelStream, Deakin et al. 2018, of its 900 GB/s peak).
ASSUMED_GPU_MEMORY_BPS = 800e9
# Bytes moved per element of a sparsified section, counted from comm/csc/'s operations in one
# sparse step: unscale (read+write 8), LARS's rescaling under momentum correction (norms of w and g
# 8, g + wd w 12, times the ratio 8: 28), momentum u <- m u + g (12), v + u into the spare (12),
# chunk norms (4), peak (4), re-scale the part (8), zero the section (4), ~density x 20 for
# packing, clearing and writing back the chosen chunks, and ~density x 48 for the release cap on
# them (their residual rows 8, this step's rows 12, two norms 8, the split 20), and the trust ratio's
# noise sketch (g times the signs into a buffer 4 + 1 + 4, summed into buckets 4: 13): about 100 at
# density 0.1.
CSC_BYTES_PER_ELEMENT = 100
# Per element the fp16 wire sends: scale and cast (read 4, write 2), cast back and unscale (read 2,
# write 4).
FP16_WIRE_BYTES_PER_ELEMENT = 12
# Per element of a matrix PowerSGD compresses at rank 4 (``powerSGD_hook``): error feedback (add the
# error 12, keep a copy 8, the new error from the copy 12), P = M Q and Q = M^T P (read M twice: 8),
# M = P Q^T (write 4); the products' 2 x 4 multiply-adds per element and the orthogonalisation of the
# n x 4 P are far below a GPU's compute per byte moved.
LOW_RANK_BYTES_PER_ELEMENT = 44
# torchvision AlexNet parameter tensors (weights and biases), in forward order
ALEXNET_LAYERS: tuple[tuple[int, bool], ...] = (
    (64 * 3 * 11 * 11, False), (64, True), (192 * 64 * 5 * 5, False), (192, True),
    (384 * 192 * 3 * 3, False), (384, True), (256 * 384 * 3 * 3, False), (256, True),
    (256 * 256 * 3 * 3, False), (256, True), (4096 * 9216, False), (4096, True),
    (4096 * 4096, False), (4096, True), (1000 * 4096, False), (1000, True))


def paper_profile() -> ModelProfile:
    step = PAPER_PER_GPU_BATCH / PAPER_SINGLE_GPU_IMAGES_S
    elements = [e for e, _ in ALEXNET_LAYERS]
    flags = [flat for _, flat in ALEXNET_LAYERS]
    return uniform_profile(elements, step * (1 - ASSUMED_BACKWARD_SHARE), step * ASSUMED_BACKWARD_SHARE,
                           0.0, flags)


def gpu_local_work(profile: ModelProfile, memory_Bps: float = ASSUMED_GPU_MEMORY_BPS) -> ModelProfile:
    """``profile`` with CSC's, the fp16 wire's and PowerSGD's local work priced for a GPU of ``memory_Bps``."""
    return replace(profile, sparsify_s_per_element=CSC_BYTES_PER_ELEMENT / memory_Bps,
                   wire_cast_s_per_element=FP16_WIRE_BYTES_PER_ELEMENT / memory_Bps,
                   low_rank_s_per_element=LOW_RANK_BYTES_PER_ELEMENT / memory_Bps)


def paper_network() -> Network:
    return Network(PAPER_LINK_GBPS * 1e9 / 8, ASSUMED_LATENCY_S, ASSUMED_GPUS_PER_NODE,
                   ASSUMED_INTRA_NODE_BPS, ASSUMED_LATENCY_S, nccl=True)


def paper_dense_ratio() -> tuple[float, str]:
    """Dense fp32 ring traffic time over compute time per step on the paper's cluster, with the
    arithmetic spelled out (what `make reproduce` matches with its link rate)."""
    profile, net = paper_profile(), paper_network()
    compute = profile.forward_s + profile.backward_s
    payload = profile.elements * 4
    comm = 2 * (PAPER_GPUS - 1) / PAPER_GPUS * payload / net.bandwidth_Bps
    text = (f"single-GPU throughput {PAPER_SINGLE_GPU_IMAGES_S:,.0f} images/s = {IMAGENET_TRAIN:,} x "
            f"{PAPER_EPOCHS} images / {PAPER_MINUTES * 60:.0f} s / {PAPER_SPEEDUP} (the paper's own figures), "
            f"so a {PAPER_PER_GPU_BATCH}-image step computes in {compute * 1e3:.1f} ms; AlexNet's "
            f"{profile.elements / 1e6:.1f}M fp32 gradients ({payload / 1e6:.0f} MB) cross each link "
            f"2(N-1)/N times per ring allreduce: at {PAPER_LINK_GBPS} Gbit/s ({net.bandwidth_Bps / 1e9:.1f} GB/s) "
            f"and N = {PAPER_GPUS} that is {comm * 1e3:.1f} ms; ratio {comm / compute:.2f}")
    return comm / compute, text

"""Measurements that feed the scaling model (``perfmodel``): a model's backward profile on this
device, and the local work per gradient element of CSC, of the fp16 wire and of PowerSGD
(``low_rank_work``: torch's own orthogonalisation and the hook's matrix products on the model's
shapes; the model takes the figure as an input and stays torch-free).

``measure_profile`` times a training step with a hook on every parameter (when its gradient is
complete); ``measure_sparsify_s_per_element`` and ``measure_wire_cast_s_per_element`` time the same
operations as ``comm/csc/`` and ``comm/compression.py`` (``sparsify_work``, ``wire_cast_work``:
the emulated cluster's benchmark times them on every rank at once). ``profile_model`` does all three for a
configured model on the per-rank batch and writes them as JSON; `make reproduce` runs it in a
process of its own:

    python -m gradientflow_repro.scaling.profile OUT.json -- HYDRA_OVERRIDES...   # PROFILE_WORLD=4

For the projection to the paper's cluster the profile comes from FLOPs instead (``flop_profile``):
backward's work per gradient tensor counted by ``torch.utils.flop_counter.FlopCounterMode``, scaled
to the step time that the paper's single-GPU throughput implies. Why FLOPs and not this machine's
timings: a CPU's per-layer time ratios are not a GPU's (its GEMMs for the fully connected layers and
its convolutions run at very different fractions of peak, and not the ones cuDNN and cuBLAS reach),
while FLOPs are the same on every device. Why not parameter counts (``perfmodel.uniform_profile``):
AlexNet's fully connected layers hold ~96% of its parameters but the convolutions do ~91% of its
backward FLOPs. Backward reaches the classifier first, so spread by parameters it spends nearly all
of its time there: the first fully connected layer's gradient (62% of the bytes) is ready at 96% of
backward instead of 9%, ~22 ms later in the paper's 39 ms step, and overlap has almost nothing left
to hide communication behind. ``flop_readiness`` runs on the ``meta`` device where it can (shapes
only: fast, and no memory).

The FLOP counts of the models the projection is usually asked about (``SHIPPED``: ours and the
torchvision models of published large-scale runs) ship with the package as small JSON files in
``profiles/`` (``NAME-SIZE.json``), so that ``scripts/simulate_scaling.py`` projects them without
importing torch; ``flops_per_image`` reads them and counts any other model. They are written by
``write_shipped_profiles`` (``python -m gradientflow_repro.scaling.profile --shipped``), and a test
checks that each file still equals what the count gives, so a change in a model or in torch's
counter cannot leave them stale unnoticed.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Optional, Sequence

from gradientflow_repro.scaling.perfmodel import ModelProfile, TensorProfile

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    import torch
    from torch import Tensor, nn


def _median_seconds(work: Callable[[], None], repeats: int) -> float:
    """Median wall-clock seconds of ``work()`` over ``repeats`` calls after one warm-up call, on one
    thread, as each rank runs (``cluster.world.run_rank``, ``threads_per_rank``): the models
    multiply a local-work figure by the ranks sharing each core, so one taken on torch's threads
    of every core would be short by their speed-up."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        times = []
        for _ in range(repeats + 1):
            started = time.perf_counter()
            work()
            times.append(time.perf_counter() - started)
    finally:
        torch.set_num_threads(threads)
    return statistics.median(times[1:])


def sparsify_work(elements: int, chunk: int = 32768, density: float = 0.1, noise_sketch: bool = True,
                  device: Optional[torch.device] = None) -> tuple[Callable[[], None], int]:
    """CSC's local work on ``device`` (None: the CPU) as a call, and the gradient elements one call
    covers: LARS's rescaling under momentum correction (``csc.lars_rescale_``), with its noise sketch
    (``csc.sketch_into``, unless not ``noise_sketch``), ``csc.BucketState``'s own step
    (momentum, residual, chunk norms with the fp16 peak, selection, packing, the ``gradientflow``
    preset's release cap, clearing, commit) and the write-back into the pool part, with summing
    functions that send nothing. It is the work under momentum correction (the presets'): without
    it CSC does less, and the model, which prices this figure, would overcharge such a variant."""
    import torch

    from gradientflow_repro.comm.base import CommStats
    from gradientflow_repro.comm.csc import BucketState, lars_rescale_, sketch_into, sketch_signs
    from gradientflow_repro.comm.knobs import TRUST_SKETCH_BUCKETS, presets

    class Nothing:  # a summing function that sends nothing, with the fp16 wire's bounded entry
        def __call__(self, tensor: torch.Tensor, stats: CommStats) -> None:
            pass

        def sum_bounded(self, tensor: torch.Tensor, bound: torch.Tensor, stats: CommStats) -> None:
            pass

    device = device or torch.device("cpu")
    chunks = max(1, elements // chunk)
    state = BucketState.zeros(chunks, chunk, device, velocity_elements=chunks * chunk)
    gradient, pool = torch.randn(chunks * chunk, device=device), torch.empty(chunks, chunk, device=device)
    weight = torch.randn(chunks * chunk, device=device)
    lars = {"weight_decay": 5e-4, "trust_coeff": 0.001, "eps": 1e-8}
    nothing = Nothing()
    release_cap = float(presets()["gradientflow"].get("release_cap", 0.0))
    signs, sketch = sketch_signs(gradient.numel(), device), torch.empty(TRUST_SKETCH_BUCKETS, device=device)

    def local_work() -> None:
        if noise_sketch:  # into the spare residual, as TrustNoise.sketch does
            sketch_into(sketch, gradient, signs, state.scratch.view(-1))
        lars_rescale_([gradient], [weight], [lars])
        moved = state.add_momentum(gradient, 0.9)
        sent = state.sparsify(moved.view(chunks, chunk), density, nothing, nothing, CommStats(), mask_after=0.0,
                              release_cap=release_cap)
        pool.zero_().index_copy_(0, sent.chosen, sent.summed)
        state.commit()

    return local_work, chunks * chunk


def wire_cast_work(elements: int) -> tuple[Callable[[], None], int]:
    """The fp16 wire's local work on this device as a call, and the elements it sends: the same
    calls as ``comm/compression.py`` and ``comm/ring.py`` make (peak magnitude and its power-of-two
    scale, scale and cast to fp16, the ring's fp16 reduction, which adds in fp32 and rounds once:
    (N-1)/N of the elements, counted whole, cast back and unscale)."""
    import torch

    from gradientflow_repro.comm.compression import compress, decompress, peak_magnitude, scale_for

    gradient = torch.randn(max(1, elements))
    arrived = torch.randn(gradient.numel()).to(torch.float16)

    def local_work() -> None:
        scale = scale_for(4 * peak_magnitude(gradient).double())
        wire = compress(gradient, scale)
        wire.add_(arrived)  # as ring.py reduces a low-precision segment
        decompress(wire, gradient, scale)

    return local_work, gradient.numel()


def low_rank_work(shapes: Sequence[tuple[int, ...]], rank: int = 4,
                  min_compression_rate: float = 2.0) -> tuple[Callable[[], None], int]:
    """PowerSGD's local work on this device for gradients of ``shapes`` as a call, and the elements
    of the matrices it compresses (those ``perfmodel.low_rank_split`` compresses), as
    ``powerSGD_hook`` does it per bucket with error feedback and warm start:
    1. add the error of the last step to the gradient and keep a copy;
    2. P = M Q for each n x m matrix M (Q: m x r, kept from the last step);
    3. orthogonalise P (torch's own ``_orthogonalize``: QR above rank 2), Q = M^T P;
    4. M = P Q^T, and the new error: the copy less M.
    The allreduces between the steps send nothing here; the vectors sent whole do no work."""
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _orthogonalize

    from gradientflow_repro.scaling.perfmodel import TensorProfile, low_rank_split

    matrices = []
    for shape in shapes:
        elements = 1
        for size in shape:
            elements *= size
        rows = shape[0] if shape else 1
        if low_rank_split([TensorProfile(elements, 0.0, len(shape) <= 1, rows)], rank, min_compression_rate)[3]:
            matrices.append((rows, elements // rows))
    generator = torch.Generator().manual_seed(0)
    work = [(torch.randn(n, m, generator=generator), torch.zeros(n, m),
             torch.randn(1, m, min(n, m, rank), generator=generator)) for n, m in matrices]

    def local_work() -> None:
        for gradient, error, q in work:
            gradient.add_(error)
            copy = gradient.clone()
            matrix = gradient.unsqueeze(0)
            p = torch.bmm(matrix, q)
            _orthogonalize(p)
            torch.bmm(matrix.transpose(1, 2), p, out=q)
            torch.bmm(p, q.transpose(1, 2), out=matrix)
            torch.sub(copy, gradient, out=error)

    return local_work, sum(n * m for n, m in matrices)


def measure_low_rank_s_per_element(shapes: Sequence[tuple[int, ...]], rank: int = 4, repeats: int = 5) -> float:
    """Seconds per compressed element of PowerSGD's local work (``low_rank_work``), one process
    alone; 0 where nothing would be compressed."""
    work, covered = low_rank_work(shapes, rank)
    return _median_seconds(work, repeats) / covered if covered else 0.0


def measure_sparsify_s_per_element(elements: int, chunk: int = 32768, density: float = 0.1,
                                   repeats: int = 5) -> float:
    """Seconds per gradient element of CSC's local work (``sparsify_work``), one process alone."""
    work, covered = sparsify_work(elements, chunk, density)
    return _median_seconds(work, repeats) / covered


def measure_wire_cast_s_per_element(elements: int, repeats: int = 20) -> float:
    """Seconds per element of the fp16 wire's local work (``wire_cast_work``), one process alone."""
    work, covered = wire_cast_work(elements)
    return _median_seconds(work, repeats) / covered


def measure_profile(model: Any, images: Any, labels: Any, repeats: int = 5) -> ModelProfile:
    """Profile one training step of ``model`` (a torch module) on this device: forward, backward
    with the time each parameter's gradient is complete (post-accumulate-grad hooks), and an
    SGD-like update (``profile_model`` times the run's own optimizer instead,
    ``measure_optimizer_s``). Medians over ``repeats`` steps after one warm-up. A tensor of at most
    one dimension is marked ``one_dimensional`` (CSC sends it densely, as ``comm/csc/`` lays out)."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    ready: dict[int, float] = {}
    clock = {"backward": 0.0}
    handles = [p.register_post_accumulate_grad_hook(
        lambda p, i=i: ready.__setitem__(i, time.perf_counter() - clock["backward"]))
        for i, p in enumerate(params)]
    criterion = torch.nn.CrossEntropyLoss()
    samples: list[tuple[float, float, float, dict[int, float]]] = []
    try:
        for _ in range(repeats + 1):
            model.zero_grad(set_to_none=True)
            started = time.perf_counter()
            loss = criterion(model(images), labels)
            clock["backward"] = time.perf_counter()
            loss.backward()
            backward_end = time.perf_counter()
            with torch.no_grad():
                for p in params:
                    p.add_(p.grad, alpha=-1e-6)
            samples.append((clock["backward"] - started, backward_end - clock["backward"],
                            time.perf_counter() - backward_end, dict(ready)))
    finally:
        for handle in handles:
            handle.remove()
    samples = samples[1:]
    order = sorted(range(len(params)), key=lambda i: statistics.median(s[3][i] for s in samples))
    tensors = tuple(TensorProfile(params[i].numel(), statistics.median(s[3][i] for s in samples),
                                  params[i].dim() <= 1, matrix_rows(params[i])) for i in order)
    return ModelProfile(statistics.median(s[0] for s in samples), statistics.median(s[1] for s in samples),
                        statistics.median(s[2] for s in samples), tensors)


def measure_optimizer_s(optimizer: Any, repeats: int = 10) -> tuple[float, float]:
    """Seconds per step of ``optimizer`` on the gradients its parameters hold, as configured and
    as it runs while CSC's momentum correction has taken over its momentum, weight decay and
    adaptation (``CSCCommunicator.TAKEN``, plain SGD): medians after one warm-up step. Its
    settings are restored; its parameters and state are not (a profile's model is thrown away)."""
    from gradientflow_repro.comm.csc import CSCCommunicator

    own = [dict(group) for group in optimizer.param_groups]
    whole = _median_seconds(optimizer.step, repeats)
    for group in optimizer.param_groups:
        group.update({key: plain for key, plain in CSCCommunicator.TAKEN if key in group})
    plain = _median_seconds(optimizer.step, repeats)
    for group, settings in zip(optimizer.param_groups, own):
        group.update(settings)
    return whole, plain


def profile_model(out: Path, overrides: Sequence[str], world: int = 4) -> None:
    """The configured model's per-tensor backward profile in this process, on the per-rank batch of
    ``world`` ranks, and the local work per element; written to ``out`` as JSON."""
    import torch

    from gradientflow_repro.comm.csc import CSCKeys
    from gradientflow_repro.comm.powersgd import PowerSGDKeys
    from gradientflow_repro.config import compose  # Hydra: here only (the GPU check imports sparsify_work without it)
    from gradientflow_repro.models import build_model
    from gradientflow_repro.optim import build_optimizer

    cfg = compose(overrides)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model(cfg.model.name, cfg.data.num_classes, cfg.data.image_size, cfg.model.width,
                        cfg.model.dropout)
    batch = max(1, cfg.global_batch_size // world)
    images = torch.randn(batch, 3, cfg.data.image_size, cfg.data.image_size)
    labels = torch.randint(0, cfg.data.num_classes, (batch,))
    profile = measure_profile(model, images, labels)
    # the run's own optimizer (Lars: several times the SGD-like update), on the last step's gradients
    optimizer_s, plain_optimizer_s = measure_optimizer_s(build_optimizer(model, cfg.optim, cfg.global_batch_size))
    # the sparsifiers' local work at the experiment's sizes where it sets them (comm.chunk_size for
    # whichever strategy runs under it), else at their declared defaults
    sparsify = measure_sparsify_s_per_element(profile.elements, cfg.comm.get("chunk_size") or CSCKeys().chunk_size)
    cast = measure_wire_cast_s_per_element(profile.elements)
    low_rank = measure_low_rank_s_per_element([tuple(p.shape) for p in model.parameters() if p.requires_grad],
                                              cfg.comm.get("powersgd_rank") or PowerSGDKeys().powersgd_rank)
    out.write_text(json.dumps({"forward_s": profile.forward_s, "backward_s": profile.backward_s,
                               "optimizer_s": optimizer_s, "plain_optimizer_s": plain_optimizer_s,
                               "sparsify_s_per_element": sparsify, "wire_cast_s_per_element": cast,
                               "low_rank_s_per_element": low_rank, "batch": batch,
                               "tensors": [[t.elements, t.ready_s, t.one_dimensional, t.rows]
                                           for t in profile.tensors]}))


def profile_from_json(data: dict) -> ModelProfile:
    """The ``ModelProfile`` that ``profile_model`` wrote."""
    return ModelProfile(data["forward_s"], data["backward_s"], data["optimizer_s"],
                        tuple(TensorProfile(*t[:3], t[3] if len(t) > 3 else None) for t in data["tensors"]),
                        data.get("sparsify_s_per_element", 0.0), data.get("wire_cast_s_per_element", 0.0),
                        data.get("plain_optimizer_s"), data.get("low_rank_s_per_element", 0.0))


class TensorFlops(NamedTuple):
    """One gradient tensor in a FLOP count: its size, the backward FLOPs done when it is complete, and
    its first dimension (the rows of PowerSGD's matrix view; None in files counted before it was kept)."""
    elements: int
    backward_flops_done: int
    one_dimensional: bool
    rows: Optional[int] = None


class FlopReadiness(NamedTuple):
    """What ``flop_readiness`` counts; unpacks as ``(forward_flops, backward_flops, tensors)``."""
    forward_flops: int
    backward_flops: int
    tensors: tuple[TensorFlops, ...]  # in the order backward completes them


def flop_readiness(model: nn.Module, images: Tensor, labels: Tensor) -> FlopReadiness:
    """FLOPs of one training step's forward (to the cross-entropy loss) and backward of ``model`` on
    ``images``, and for each trainable parameter the backward FLOPs done when its gradient is
    complete: a post-accumulate-grad hook reads the running total of a
    ``torch.utils.flop_counter.FlopCounterMode`` at that moment. The counter adds an op's FLOPs when
    the op has run, so a tensor's count includes the op that produced its gradient (for a convolution
    ``convolution_backward``, which computes the input's gradient, skipped where the input needs none,
    as for the first layer, and the weight's in one op).

    An approximation of where backward's time goes: FlopCounterMode counts only matrix products,
    convolutions and attention (``flop_counter.flop_registry``); elementwise ops, BatchNorm, ReLU,
    pooling, dropout and the loss count zero. On a GPU those are memory-bound and a minority of a
    convolutional network's step (a few %, more with BatchNorm on large activations), so their time
    is in effect spread in proportion to the counted work: the proportions, not an exact timing.

    Any device works; on ``meta`` (shapes only) it is fast and allocates nothing. Tensors are listed
    in the order their hooks fire; a parameter that gets no gradient comes last, at the end of
    backward. Leaves the gradients in ``.grad``, as a backward does; nothing is updated."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    params = [p for p in model.parameters() if p.requires_grad]
    counter = FlopCounterMode(display=False)
    done: dict[int, int] = {}  # parameter index -> backward FLOPs done at its gradient; in firing order
    forward = {"flops": 0}

    def mark(index: int) -> Callable[[Any], None]:
        def hook(_: Any) -> None:  # must return None: autograd rejects anything else
            done.setdefault(index, counter.get_total_flops() - forward["flops"])
        return hook

    handles = [p.register_post_accumulate_grad_hook(mark(i)) for i, p in enumerate(params)]
    try:
        with torch.enable_grad(), counter:
            output = model(images)
            if isinstance(output, (tuple, list)):  # e.g. Inception's (logits, aux_logits) in training
                output = output[0]
            loss = torch.nn.functional.cross_entropy(output, labels)
            forward["flops"] = counter.get_total_flops()
            loss.backward()
        backward = counter.get_total_flops() - forward["flops"]
    finally:
        for handle in handles:
            handle.remove()
    order = list(done) + [i for i in range(len(params)) if i not in done]
    tensors = tuple(TensorFlops(params[i].numel(), done.get(i, backward), params[i].dim() <= 1, matrix_rows(params[i]))
                    for i in order)
    return FlopReadiness(forward["flops"], backward, tensors)


def matrix_rows(parameter: Any) -> int:
    """A parameter's first dimension (its elements for a scalar): the rows PowerSGD views it with."""
    return int(parameter.shape[0]) if parameter.dim() else 1


OUR_MODELS = ("alexnet_bn", "alexnet", "resnet50")  # gradientflow_repro.models.build_model


def build_named_model(name: str, num_classes: int, image_size: int) -> nn.Module:
    """A classification model by name, on the current default device: ours
    (``gradientflow_repro.models.build_model``), else torchvision's
    (``torchvision.models.get_model``), else timm's (``timm.create_model``, if timm is installed).
    ``image_size`` reaches only ours; torchvision's and timm's take any size their pooling allows."""
    if name in OUR_MODELS:
        from gradientflow_repro.models import build_model

        return build_model(name, num_classes, image_size)
    import torchvision

    if name in torchvision.models.list_models(module=torchvision.models):
        return torchvision.models.get_model(name, weights=None, num_classes=num_classes)
    try:
        import timm
    except ImportError:
        timm_says = "timm is not installed"
    else:
        if timm.is_model(name):
            return timm.create_model(name, pretrained=False, num_classes=num_classes)
        timm_says = "not in timm.list_models()"
    raise ValueError(_unknown_model(name, timm_says))


def _unknown_model(name: str, timm_says: str) -> str:
    return (f"unknown model '{name}': not ours ({', '.join(OUR_MODELS)}), not a torchvision "
            f"classification model (torchvision.models.list_models(module=torchvision.models)), and {timm_says}")


def model_name_error(name: str) -> Optional[str]:
    """Why ``build_named_model`` cannot build ``name`` (one line), or None where it can. Ours and the
    shipped models are known without importing anything; any other name asks torchvision and timm
    (importing torch), without building the model."""
    if ships(name):
        return None
    try:
        import torchvision
    except ImportError as error:  # a machine without torch: only the shipped models can be projected
        shipped = ", ".join(sorted({model for model, _ in SHIPPED} | set(OUR_MODELS)))
        return f"unknown model '{name}': not shipped ({shipped}), and torchvision cannot be imported ({error})"
    if name in torchvision.models.list_models(module=torchvision.models):
        return None
    try:
        import timm
    except ImportError:
        return _unknown_model(name, "timm is not installed")
    return None if timm.is_model(name) else _unknown_model(name, "not in timm.list_models()")


_COUNT_BATCH = 2  # BatchNorm in training mode needs more than one value per channel


# (model, image size) whose FLOP counts ship in ``profiles/`` (1000 classes): ours, and the torchvision
# models of published large-scale runs (ResNet-101, VGG-16, Inception-v3 at its own 299 pixels)
SHIPPED: tuple[tuple[str, int], ...] = (("alexnet_bn", 224), ("alexnet", 224), ("resnet50", 224),
                                        ("resnet101", 224), ("inception_v3", 299), ("vgg16", 224))
SHIPPED_CLASSES = 1000
PROFILE_DIR = Path(__file__).resolve().parent / "profiles"


def shipped_path(model_name: str, image_size: int) -> Path:
    """Where the FLOP counts of ``model_name`` at ``image_size`` pixels ship (whether or not they do)."""
    return PROFILE_DIR / f"{model_name}-{image_size}.json"


def flops_as_json(counted: FlopReadiness, model_name: str, image_size: int, num_classes: int) -> dict[str, Any]:
    """``counted`` as the shipped files hold it: what was counted, then the counts."""
    return {"model": model_name, "image_size": image_size, "num_classes": num_classes,
            "forward_flops": counted.forward_flops, "backward_flops": counted.backward_flops,
            "tensors": [[t.elements, t.backward_flops_done, t.one_dimensional, t.rows] for t in counted.tensors]}


def flops_from_json(data: dict[str, Any]) -> FlopReadiness:
    """The ``FlopReadiness`` a shipped file holds (``flops_as_json``)."""
    return FlopReadiness(int(data["forward_flops"]), int(data["backward_flops"]),
                         tuple(TensorFlops(int(t[0]), int(t[1]), bool(t[2]), t[3] if len(t) > 3 else None)
                               for t in data["tensors"]))


def shipped_flops(model_name: str, image_size: int, num_classes: int = 1000) -> Optional[FlopReadiness]:
    """The shipped FLOP counts of ``model_name`` at ``image_size`` pixels and ``num_classes`` classes;
    None where none ship (then ``count_flops_per_image`` counts them). Reads JSON only: no torch."""
    path = shipped_path(model_name, image_size)
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    if (data.get("model"), data.get("image_size"), data.get("num_classes")) != (model_name, image_size, num_classes):
        return None
    return flops_from_json(data)


def ships(model_name: str) -> bool:
    """Whether some image size of ``model_name`` ships, or it is ours: a name known without torch."""
    return model_name in OUR_MODELS or any(name == model_name for name, _ in SHIPPED)


def write_shipped_profiles(directory: Path = PROFILE_DIR) -> list[Path]:
    """Count every model of ``SHIPPED`` (``count_flops_per_image``) and write its file into
    ``directory``; returns the paths. Run again when a model or torch's FLOP counter changes (the
    test that compares the files with a fresh count says when)."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for model_name, image_size in SHIPPED:
        counted = count_flops_per_image(model_name, image_size, SHIPPED_CLASSES)
        path = directory / shipped_path(model_name, image_size).name
        path.write_text(json.dumps(flops_as_json(counted, model_name, image_size, SHIPPED_CLASSES)) + "\n")
        written.append(path)
    return written


@functools.lru_cache(maxsize=None)
def flops_per_image(model_name: str, image_size: int, num_classes: int = 1000) -> FlopReadiness:
    """``flop_readiness`` of the named model per image of ``image_size`` pixels: the shipped counts
    where they exist (``shipped_flops``: no torch), else counted (``count_flops_per_image``). Cached:
    a scaling sweep asks many times."""
    shipped = shipped_flops(model_name, image_size, num_classes)
    return shipped if shipped is not None else count_flops_per_image(model_name, image_size, num_classes)


def count_flops_per_image(model_name: str, image_size: int, num_classes: int = 1000) -> FlopReadiness:
    """``flop_readiness`` of the named model (``build_named_model``) per image of ``image_size``
    pixels: counted on a batch of two and halved (the counted ops are linear in the batch). Built and
    run on the ``meta`` device; a model that cannot be (an op without a meta kernel, a value read
    with ``.item()``) is rebuilt and counted on the CPU."""
    import torch

    counted: Optional[FlopReadiness] = None
    for device in ("meta", "cpu"):
        try:
            with torch.device(device):
                model = build_named_model(model_name, num_classes, image_size)
                images = torch.randn(_COUNT_BATCH, 3, image_size, image_size)
                labels = torch.randint(0, num_classes, (_COUNT_BATCH,))
                counted = flop_readiness(model, images, labels)
            break
        except (NotImplementedError, RuntimeError):
            if device == "cpu":
                raise
    assert counted is not None
    return FlopReadiness(counted.forward_flops // _COUNT_BATCH, counted.backward_flops // _COUNT_BATCH,
                         tuple(t._replace(backward_flops_done=t.backward_flops_done // _COUNT_BATCH)
                               for t in counted.tensors))


def flop_profile(model_name: str, image_size: int, images_per_gpu: int, single_gpu_images_s: float,
                 num_classes: int = 1000, optimizer_s: float = 0.0) -> ModelProfile:
    """The named model's profile on a GPU that trains ``single_gpu_images_s`` images per second, from
    FLOPs (``flops_per_image``): a step of ``images_per_gpu`` images takes
    ``images_per_gpu / single_gpu_images_s`` seconds, of which ``optimizer_s`` is the update and the
    rest is split between forward and backward in proportion to their FLOPs; each gradient is ready
    at the share of backward's FLOPs done when it is complete. The throughput is of whole steps, so
    the update's time comes out of it rather than on top. CSC's and the fp16 wire's local work per
    element are left at zero (``dataclasses.replace`` them from a measurement)."""
    step = images_per_gpu / single_gpu_images_s
    if not 0 <= optimizer_s < step:
        raise ValueError(f"optimizer_s={optimizer_s} must be in [0, step time {step})")
    counted = flops_per_image(model_name, image_size, num_classes)
    compute = step - optimizer_s
    forward_s = compute * counted.forward_flops / (counted.forward_flops + counted.backward_flops)
    backward_s = compute - forward_s
    return ModelProfile(forward_s, backward_s, optimizer_s,
                        tuple(TensorProfile(t.elements, backward_s * t.backward_flops_done / counted.backward_flops,
                                            t.one_dimensional, t.rows) for t in counted.tensors))


def readiness_table(profile: ModelProfile,
                    against: Optional[ModelProfile] = None) -> list[tuple[int, float, Optional[float]]]:
    """For each multi-dimensional (weight) tensor of ``profile``, in backward order: its elements,
    the fraction of backward done when it is ready, and the same fraction in ``against`` (another
    profile of the same network, e.g. ``perfmodel.paper_profile()``), or None. Tensors are matched by
    size, the k-th of a size with the k-th; one-dimensional tensors are left out, since they differ
    between variants (AlexNet's biases, AlexNet-BN's BatchNorm) and are under 0.1% of the elements."""
    def fractions(p: ModelProfile) -> list[tuple[int, float]]:
        return [(t.elements, t.ready_s / p.backward_s) for t in p.tensors if not t.one_dimensional]

    theirs: dict[int, list[float]] = {}
    for elements, fraction in fractions(against) if against is not None else []:
        theirs.setdefault(elements, []).append(fraction)
    return [(elements, fraction, theirs[elements].pop(0) if theirs.get(elements) else None)
            for elements, fraction in fractions(profile)]


def main(argv: Optional[Sequence[str]] = None) -> None:
    """``OUT.json -- OVERRIDES...``; the world size from ``PROFILE_WORLD`` (default 4). ``--shipped``:
    rewrite the shipped FLOP counts (``write_shipped_profiles``)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args == ["--shipped"]:
        for path in write_shipped_profiles():
            log.info("%s", path.relative_to(PROFILE_DIR.parents[2]))
        return
    out, overrides = Path(args[0]), args[2:] if args[1:2] == ["--"] else args[1:]
    profile_model(out, overrides, int(os.environ.get("PROFILE_WORLD", "4")))


if __name__ == "__main__":
    from gradientflow_repro import logs

    logs.configure("profile")
    main()

"""Measurements that feed the scaling model (``perfmodel``): a model's backward profile on this
device, and the local work per gradient element of CSC and of the fp16 wire.

``measure_profile`` times a training step with a hook on every parameter (when its gradient is
complete); ``measure_sparsify_s_per_element`` and ``measure_wire_cast_s_per_element`` time the same
operations as ``comm/csc.py`` and ``comm/compression.py``. ``profile_model`` does all three for a
configured model on the per-rank batch and writes them as JSON; `make reproduce` runs it in a
process of its own:

    python -m gradientflow_repro.harness.profile OUT.json -- HYDRA_OVERRIDES...   # PROFILE_WORLD=4
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from gradientflow_repro.harness import REPO
from gradientflow_repro.perfmodel import ModelProfile, TensorProfile


def _median_seconds(work: Callable[[], None], repeats: int) -> float:
    """Median wall-clock seconds of ``work()`` over ``repeats`` calls after one warm-up call."""
    times = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


def measure_sparsify_s_per_element(elements: int, chunk: int = 32768, density: float = 0.1,
                                   repeats: int = 5) -> float:
    """Seconds per gradient element of CSC's local work on this device, timed on the same operations
    as ``comm/csc.py`` (velocity and residual sums, chunk norms, selection, packing, write-back)."""
    import torch

    from gradientflow_repro.comm.csc import chunk_l1_norms, select_chunks

    chunks = max(1, elements // chunk)
    gradient, residual, velocity, moved, accumulated, pool = (torch.randn(chunks, chunk) for _ in range(6))

    def local_work() -> None:  # into preallocated buffers, as csc.py writes into its spare state
        torch.add(gradient, velocity, alpha=0.9, out=moved)
        torch.add(residual, moved, out=accumulated)
        chosen = select_chunks(chunk_l1_norms(accumulated), density)
        packed = accumulated.index_select(0, chosen)
        pool.zero_()
        pool.index_copy_(0, chosen, packed)
        accumulated.index_fill_(0, chosen, 0.0)
        moved.index_fill_(0, chosen, 0.0)

    return _median_seconds(local_work, repeats) / (chunks * chunk)


def measure_wire_cast_s_per_element(elements: int, repeats: int = 5) -> float:
    """Seconds per element of the fp16 wire's local work on this device, timed on the same
    operations as ``comm/compression.py`` (peak magnitude, scale and cast to fp16, cast back and
    unscale)."""
    import torch

    from gradientflow_repro.comm.compression import compress, decompress

    gradient = torch.randn(max(1, elements))

    def local_work() -> None:
        peak = gradient.abs().max().item()
        scale = 2.0 ** -3 if peak else 1.0  # a power of two other than 1, as agreed_scale picks
        decompress(compress(gradient, scale), gradient, scale)

    return _median_seconds(local_work, repeats) / gradient.numel()


def measure_profile(model: Any, images: Any, labels: Any, repeats: int = 5) -> ModelProfile:
    """Profile one training step of ``model`` (a torch module) on this device: forward, backward
    with the time each parameter's gradient is complete (post-accumulate-grad hooks), and an
    SGD-like update. Medians over ``repeats`` steps after one warm-up. A tensor of at most one
    dimension is marked ``one_dimensional`` (CSC sends it densely, as ``comm/csc.py`` lays out)."""
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
                                  params[i].dim() <= 1) for i in order)
    return ModelProfile(statistics.median(s[0] for s in samples), statistics.median(s[1] for s in samples),
                        statistics.median(s[2] for s in samples), tensors)


def profile_model(out: Path, overrides: Sequence[str], world: int = 4) -> None:
    """The configured model's per-tensor backward profile in this process, on the per-rank batch of
    ``world`` ranks, and the local work per element; written to ``out`` as JSON."""
    import torch
    from hydra import compose, initialize_config_dir

    from gradientflow_repro.config import register_configs
    from gradientflow_repro.models import build_model

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base=None):
        cfg = compose("config", overrides=list(overrides))
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model(cfg.model.name, cfg.data.num_classes, cfg.data.image_size, cfg.model.width,
                        cfg.model.dropout)
    batch = max(1, cfg.global_batch_size // world)
    images = torch.randn(batch, 3, cfg.data.image_size, cfg.data.image_size)
    labels = torch.randint(0, cfg.data.num_classes, (batch,))
    profile = measure_profile(model, images, labels)
    sparsify = measure_sparsify_s_per_element(profile.elements, cfg.comm.chunk_size or 32768)
    cast = measure_wire_cast_s_per_element(profile.elements)
    out.write_text(json.dumps({"forward_s": profile.forward_s, "backward_s": profile.backward_s,
                               "optimizer_s": profile.optimizer_s, "sparsify_s_per_element": sparsify,
                               "wire_cast_s_per_element": cast,
                               "tensors": [[t.elements, t.ready_s, t.one_dimensional] for t in profile.tensors]}))


def profile_from_json(data: dict) -> ModelProfile:
    """The ``ModelProfile`` that ``profile_model`` wrote."""
    return ModelProfile(data["forward_s"], data["backward_s"], data["optimizer_s"],
                        tuple(TensorProfile(e, r, flat) for e, r, flat in data["tensors"]),
                        data.get("sparsify_s_per_element", 0.0), data.get("wire_cast_s_per_element", 0.0))


def main(argv: Optional[Sequence[str]] = None) -> None:
    """``OUT.json -- OVERRIDES...``; the world size from ``PROFILE_WORLD`` (default 4)."""
    args = list(sys.argv[1:] if argv is None else argv)
    out, overrides = Path(args[0]), args[2:] if args[1:2] == ["--"] else args[1:]
    profile_model(out, overrides, int(os.environ.get("PROFILE_WORLD", "4")))


if __name__ == "__main__":
    main()

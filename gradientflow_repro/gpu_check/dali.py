"""DALI on this machine: the item ``dali``.

DALI's GPU pipeline (nvJPEG decoding, ``mixed``) and its CPU pipeline each read one epoch of the
digits data set (built from scikit-learn's digits where ``data/digits`` is missing): every batch
must have the expected shape and device, and the labels must come in the epoch's order.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from gradientflow_repro import REPO
from gradientflow_repro.gpu_check.devices import cuda_device
from gradientflow_repro.gpu_check.processes import child_env, run_command, time_left
from gradientflow_repro.gpu_check.results import Reporter, need, project_imports


def digits_root() -> Path:
    """``data/digits`` of the checkout, built first where it is missing (scikit-learn, pillow)."""
    root = REPO / "data" / "digits"
    if (root / "train").is_dir() and (root / "val").is_dir():
        return root
    need("sklearn", "PIL")
    status, output, _ = run_command([sys.executable, "-m", "gradientflow_repro.data.digits", str(root)],
                                    min(180.0, time_left() - 5), cwd=REPO, env=child_env([str(REPO)]))
    if status != 0:
        last = [line for line in output.splitlines() if line.strip()][-1:] or [""]
        raise RuntimeError(f"building {root} failed (status {status}): {last[0][:300]}")
    return root


def check_dali(report: Reporter) -> None:
    """The item ``dali``: one epoch through each pipeline, batches and labels checked, images/s."""
    need("nvidia.dali")
    cuda_device(0)
    with project_imports():
        from gradientflow_repro.data.dali import DaliSource
        from gradientflow_repro.data.listing import ImageOptions, epoch_permutation, list_image_folder
    root = digits_root()
    train = list_image_folder(root / "train")
    val = list_image_folder(root / "val", train.classes)
    options = ImageOptions(image_size=32, val_resize=32, min_crop_scale=0.6, flip=False,
                           mean=(0.0,) * 3, std=(255.0,) * 3, num_threads=4, prefetch=2)
    batch = 64
    steps = len(train) // batch
    expected = [train.labels[i] for i in epoch_permutation(len(train), 0, 0)][:steps * batch]
    for label, device in (("mixed on cuda:0", torch.device("cuda", 0)), ("cpu", torch.device("cpu"))):
        with report.part(label):
            source = DaliSource(train, val, options, device=device, local_batch=batch, global_batch=batch,
                                rank=0, world_size=1, seed=0)
            labels, problems = [], []
            started = time.perf_counter()
            for images, targets in source.train_batches(0):
                if tuple(images.shape) != (batch, 3, 32, 32) or images.device.type != device.type:
                    problems.append(f"a batch of shape {tuple(images.shape)} on {images.device}")
                labels += targets.cpu().tolist()
            torch.cuda.synchronize()
            seconds = time.perf_counter() - started
            if labels != expected:
                problems.append(f"labels differ from the epoch's order ({len(labels)} read, "
                                f"{sum(a != b for a, b in zip(labels, expected))} differ)")
            detail = (f"{len(labels) / seconds:.0f} images/s over one epoch ({steps} batches of {batch}, "
                      f"32 px, pipeline build included), labels in the epoch's order")
            report.add("FAIL" if problems else "PASS",
                       ("; ".join(problems[:3]) + f" ({detail})") if problems else detail, label)

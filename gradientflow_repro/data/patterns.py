"""The paper-regime miniature's dataset: procedural textures as an ImageNet-layout JPEG folder.

Why a second embedded dataset: on the handwritten digits dense training reaches its target a quarter
of the way through its 132-step schedule, where any error-feedback method (CSC's delayed chunks, its
momentum correction) pays its delay in full. ImageNet under the paper's recipe is the opposite: top-1
rises until the learning rate has decayed, the target is met at the end of 95 epochs, and a chunk's
wait of ~1/density steps is a small share of the schedule. This dataset is built to behave that way on
two CPU cores (docs/notes/2026-12-06-paper-regime-miniature.md).

What an image is. Each of ``CLASSES`` classes owns ``PROTOTYPES`` smooth random RGB fields (Gaussian
noise blurred twice with a box filter, unit standard deviation). An image of class c is one of c's
prototypes, circularly shifted by up to ``SHIFT`` pixels, scaled by an amplitude in [0.6, 1.4], plus
a distractor (a prototype of any class, shifted, at up to ``DISTRACTOR`` of its amplitude), plus
per-pixel Gaussian noise of ``NOISE`` standard deviations, written as a 32x32 JPEG. The label is
always the main prototype's class: the task is learnable to near 100% in the limit, but the noise and
the distractors make a finite training set hard to fit, so accuracy keeps rising as long as SGD's own
noise falls, i.e. until the learning rate has decayed.

Deterministic (one NumPy generator from ``SEED``; the split is fixed) and atomic (a temporary folder
renamed at the end): an interrupted build never leaves a half dataset behind.

    python -m gradientflow_repro.data.patterns data/patterns
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from gradientflow_repro.data.embedded import command_line, write_atomically

CLASSES = 10
PROTOTYPES = 8  # per class
IMAGE_SIZE = 32
SHIFT = 6  # pixels, each direction
NOISE = 2.8  # per-pixel noise, in units of a prototype's standard deviation
DISTRACTOR = 0.9  # a distractor's amplitude, at most, relative to the main prototype's
TRAIN_PER_CLASS = 640  # 6,400 training images: 50 steps per epoch at a global batch of 128
VAL_PER_CLASS = 200  # 2,000 validation images: one image is 0.05 points
SEED = 20261206
CONTRAST = 40.0  # grey levels per standard deviation around 128 (noise past +-3.2 sd is clipped)


def _box_blur(fields: np.ndarray, width: int) -> np.ndarray:
    """A circular box blur of ``width`` pixels over the last two axes."""
    out = fields
    for axis in (-1, -2):
        out = sum(np.roll(out, shift, axis=axis) for shift in range(-(width // 2), width // 2 + 1)) / width
    return out


def prototypes(rng: np.random.Generator) -> np.ndarray:
    """[CLASSES * PROTOTYPES, 3, IMAGE_SIZE, IMAGE_SIZE] smooth random fields of unit standard deviation."""
    fields = rng.standard_normal((CLASSES * PROTOTYPES, 3, IMAGE_SIZE, IMAGE_SIZE))
    fields = _box_blur(_box_blur(fields, 5), 5)
    fields -= fields.mean(axis=(1, 2, 3), keepdims=True)
    return fields / fields.std(axis=(1, 2, 3), keepdims=True)


def draw(rng: np.random.Generator, protos: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Images (float, [n, 3, H, W], in prototype units) of the given class ``labels``."""
    n = labels.size
    main = labels * PROTOTYPES + rng.integers(0, PROTOTYPES, n)
    other = rng.integers(0, CLASSES * PROTOTYPES, n)
    amplitude = rng.uniform(0.6, 1.4, n)
    share = rng.uniform(0.0, DISTRACTOR, n)
    images = np.empty((n, 3, IMAGE_SIZE, IMAGE_SIZE))
    for i in range(n):
        shift_a, shift_b = rng.integers(-SHIFT, SHIFT + 1, (2, 2))
        images[i] = amplitude[i] * (np.roll(protos[main[i]], tuple(shift_a), axis=(1, 2))
                                    + share[i] * np.roll(protos[other[i]], tuple(shift_b), axis=(1, 2)))
    return images + NOISE * rng.standard_normal(images.shape)


def to_pixels(images: np.ndarray) -> np.ndarray:
    """[n, H, W, 3] uint8 pixels of ``draw``'s images."""
    return np.clip(128.0 + CONTRAST * images, 0, 255).astype(np.uint8).transpose(0, 2, 3, 1)


def build_patterns(root: str | Path, force: bool = False) -> Path:
    """Write the dataset under ``root`` (``train/<class>/*.JPEG``, ``val/<class>/*.JPEG``) unless it is
    there already (``force``: rebuild)."""
    return write_atomically(root, force, _write_patterns)


def _write_patterns(tmp: Path) -> None:
    from PIL import Image

    rng = np.random.default_rng(SEED)
    protos = prototypes(rng)
    for split, per_class in (("train", TRAIN_PER_CLASS), ("val", VAL_PER_CLASS)):
        labels = np.repeat(np.arange(CLASSES), per_class)
        pixels = to_pixels(draw(rng, protos, labels))
        for index, (picture, label) in enumerate(zip(pixels, labels)):
            folder = tmp / split / f"pattern_{label}"
            folder.mkdir(parents=True, exist_ok=True)
            buffer = io.BytesIO()
            Image.fromarray(picture, mode="RGB").save(buffer, format="JPEG", quality=95)
            (folder / f"{split}_{index:05d}.JPEG").write_bytes(buffer.getvalue())


def main() -> None:
    command_line(__doc__, "patterns", build_patterns, CLASSES)


if __name__ == "__main__":
    main()

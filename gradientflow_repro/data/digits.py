"""The embedded default dataset: scikit-learn's handwritten digits as an ImageNet-layout JPEG folder.

1,797 real 8x8 scans (UCI optical digits, shipped inside scikit-learn) in 10 classes, upscaled to
32x32 RGB JPEGs under ``train/<class>/*.JPEG`` and ``val/<class>/*.JPEG`` so that the very same file
reader that reads ImageNet reads them. The split is fixed: every fifth image of each class (in
scikit-learn's order) is validation. Writing is deterministic and atomic (a temporary folder renamed
at the end), so an interrupted build never leaves a half dataset behind.

    python -m gradientflow_repro.data.digits data/digits
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from gradientflow_repro.data.embedded import command_line, write_atomically

IMAGE_SIZE = 32
VAL_EVERY = 5


def build_digits(root: str | Path, force: bool = False) -> Path:
    """Write the dataset under ``root`` unless it is there already (``force``: rebuild)."""
    return write_atomically(root, force, _write_digits)


def _write_digits(tmp: Path) -> None:
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    seen_per_class: dict[int, int] = {}
    for index, (image, label) in enumerate(zip(digits.images, digits.target)):
        label = int(label)
        position = seen_per_class.get(label, 0)
        seen_per_class[label] = position + 1
        split = "val" if position % VAL_EVERY == VAL_EVERY - 1 else "train"
        folder = tmp / split / f"digit_{label}"
        folder.mkdir(parents=True, exist_ok=True)
        pixels = np.clip(image * (255.0 / 16.0), 0, 255).astype(np.uint8)
        picture = Image.fromarray(pixels, mode="L").resize((IMAGE_SIZE, IMAGE_SIZE), Image.BICUBIC)
        picture.convert("RGB").save(folder / f"digit_{index:04d}.JPEG", quality=95)


def main() -> None:
    command_line(__doc__, "digits", build_digits, 10)


if __name__ == "__main__":
    main()

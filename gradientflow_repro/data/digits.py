"""The embedded default dataset: scikit-learn's handwritten digits as an ImageNet-layout JPEG folder.

1,797 real 8x8 scans (UCI optical digits, shipped inside scikit-learn) in 10 classes, upscaled to
32x32 RGB JPEGs under ``train/<class>/*.JPEG`` and ``val/<class>/*.JPEG`` so that the very same file
reader that reads ImageNet reads them. The split is fixed: every fifth image of each class (in
scikit-learn's order) is validation. Writing is deterministic and atomic (a temporary folder renamed
at the end), so an interrupted build never leaves a half dataset behind.

    python -m gradientflow_repro.data.digits data/digits
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import numpy as np

IMAGE_SIZE = 32
VAL_EVERY = 5


def build_digits(root: str | Path, force: bool = False) -> Path:
    from PIL import Image
    from sklearn.datasets import load_digits

    root = Path(root)
    if (root / "train").is_dir() and (root / "val").is_dir() and not force:
        return root
    digits = load_digits()
    tmp = root.with_name(root.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
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
    if force:
        shutil.rmtree(root, ignore_errors=True)
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp.rename(root)
    return root


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("root", nargs="?", default="data/digits")
    parser.add_argument("--force", action="store_true", help="rebuild even if present")
    args = parser.parse_args()
    root = build_digits(args.root, args.force)
    counts = {split: sum(1 for _ in (root / split).rglob("*.JPEG")) for split in ("train", "val")}
    print(f"digits dataset at {root}: {counts['train']} train, {counts['val']} val images, 10 classes")


if __name__ == "__main__":
    main()

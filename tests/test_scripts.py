"""scripts/prepare_imagenet.py on a small folder with planted problems."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from conftest import REPO

SCRIPT = REPO / "scripts" / "prepare_imagenet.py"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


def small_copy(digits_root: Path, dest: Path) -> Path:
    for split in ("train", "val"):
        for class_dir in sorted((digits_root / split).iterdir())[:3]:
            target = dest / split / class_dir.name
            target.mkdir(parents=True)
            for image in sorted(class_dir.iterdir())[:4]:
                shutil.copy(image, target)
    return dest


def test_check_passes_on_good_data_and_lists_bad_files(digits_root: Path, tmp_path: Path) -> None:
    root = small_copy(digits_root, tmp_path / "imagenet")
    ok = run(str(root), "--workers", "1")
    assert ok.returncode == 0 and "train: 3 classes, 12 images" in ok.stdout and ok.stdout.strip().endswith("ok")
    good = next((root / "train" / "digit_0").iterdir())
    truncated = root / "train" / "digit_0" / "truncated.JPEG"
    truncated.write_bytes(good.read_bytes()[:60])
    not_an_image = root / "val" / "digit_1" / "notes.JPEG"
    not_an_image.write_text("hello")
    (root / "train" / "digit_9").mkdir()
    from PIL import Image
    rgb = Image.open(good).convert("RGB")
    png, cmyk, gray = (root / "train" / "digit_0" / f"{name}.JPEG" for name in ("png", "cmyk", "gray"))
    rgb.save(png, format="PNG")
    rgb.convert("CMYK").save(cmyk, format="JPEG")
    rgb.convert("L").save(gray, format="JPEG")
    bad = run(str(root), "--workers", "1")
    assert bad.returncode == 1
    assert f"unreadable: {truncated}" in bad.stdout and f"unreadable: {not_an_image}" in bad.stdout
    assert f"note: {png}: PNG content behind a JPEG name" in bad.stdout
    assert f"note: {cmyk}: CMYK pixels" in bad.stdout and f"note: {gray}: L pixels" in bad.stdout
    assert "empty class folder" in bad.stdout and "classes differ between train and val" in bad.stdout


def test_arrange_flat_validation_from_labels(digits_root: Path, tmp_path: Path) -> None:
    val = tmp_path / "val"
    val.mkdir()
    lines = []
    for class_dir in sorted((digits_root / "val").iterdir())[:2]:
        for image in sorted(class_dir.iterdir())[:3]:
            shutil.copy(image, val / image.name)
            lines.append(f"{image.name} {class_dir.name}")
    (tmp_path / "labels.txt").write_text("\n".join(lines) + "\n")
    result = run(str(tmp_path), "--arrange-val", str(tmp_path / "labels.txt"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert sorted(p.name for p in val.iterdir()) == ["digit_0", "digit_1"]
    assert sum(1 for _ in val.rglob("*.JPEG")) == 6

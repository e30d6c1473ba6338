"""``channel-stats`` and the array reader of training: every user error is one
``error:`` line and exit status 2, and no statistic is computed from pixels that are not
finite, from an empty image, from mixed bit depths or from a damaged ``.npy`` header."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from ssl_lightning.cli.channel_stats import main
from ssl_lightning.data.arrays import load_array
from ssl_lightning.data.datasets import CorruptImageError


def refused(capsys: pytest.CaptureFixture, *args: str) -> str:
    """The one ``error:`` line of ``channel-stats args`` (exit status 2, no traceback)."""
    with pytest.raises(SystemExit) as exited:
        main(list(args))
    err = capsys.readouterr().err
    assert exited.value.code == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


def good_images(folder: Path, count: int = 3) -> Path:
    folder.mkdir(exist_ok=True)
    for i in range(count):
        np.save(folder / f"{i}.npy", np.full((2, 4, 4), float(i), np.float32))
    return folder


def test_a_missing_or_empty_folder_is_one_error_line(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture) -> None:
    assert "missing does not exist" in refused(capsys, "--images", str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    assert f"no images under {tmp_path / 'empty'}" in refused(
        capsys, "--images", str(tmp_path / "empty"))


@pytest.mark.parametrize("limit", ["-1", "0", "two"])
def test_a_bad_limit_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture,
                                limit: str) -> None:
    message = refused(capsys, "--images", str(good_images(tmp_path / "d")), "--limit", limit)
    assert f"--limit must be a whole number of images >= 1, got {limit!r}" in message


def test_a_limit_at_or_above_the_count_uses_every_image(tmp_path: Path) -> None:
    assert main(["--images", str(good_images(tmp_path / "d")), "--limit", "3"])[2] == 3
    assert main(["--images", str(tmp_path / "d"), "--limit", "1"])[2] == 1


@pytest.mark.parametrize(("name", "pixels", "expected"), [
    ("nan.npy", np.array([[[0.0, np.nan]], [[1.0, 2.0]]], np.float32), "1 NaN or infinite"),
    ("inf.npy", np.array([[[0.0, np.inf]], [[-np.inf, 2.0]]], np.float32), "2 NaN or infinite"),
    ("empty.npy", np.zeros((2, 0, 8), np.float32), "holds no pixel (shape (2, 0, 8))"),
    ("object.npy", np.array([[[None, 1]], [[2, 3]]], dtype=object), "dtype object is not"),
    ("three.npy", np.zeros((3, 4, 4), np.float32), "has 3 channels, the images before it 2"),
])
def test_a_bad_image_is_named_and_refused(tmp_path: Path, capsys: pytest.CaptureFixture,
                                          name: str, pixels: np.ndarray, expected: str) -> None:
    folder = good_images(tmp_path / "d")
    np.save(folder / name, pixels, allow_pickle=True)
    message = refused(capsys, "--images", str(folder))
    assert str(folder / name) in message and expected in message


def test_the_array_reader_of_training_refuses_non_finite_and_empty_images(
        tmp_path: Path) -> None:
    np.save(tmp_path / "nan.npy", np.array([[1.0, np.nan]], np.float32))
    np.save(tmp_path / "empty.npy", np.zeros((3, 0, 8), np.float32))
    for name in ("nan.npy", "empty.npy"):
        with pytest.raises(CorruptImageError, match=f"{tmp_path / name}: it holds"):
            load_array(tmp_path / name)


def test_a_16_bit_png_beside_8_bit_ones_is_refused_naming_both(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    Image.fromarray(np.full((4, 4), 200, np.uint8)).save(tmp_path / "a.png")
    Image.fromarray(np.full((4, 4), 50000, np.uint16)).save(tmp_path / "b.png")
    message = refused(capsys, "--images", str(tmp_path))
    assert f"{tmp_path / 'b.png'} holds uint16 pixels, {tmp_path / 'a.png'} uint8" in message


def test_a_npy_header_larger_than_its_file_is_refused_before_allocating(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """(3, 99999, 99999) float32 would be 112 GiB: the header is checked against the file's
    size before anything is read or allocated."""
    path = tmp_path / "huge.npy"
    with open(path, "wb") as file:
        np.lib.format.write_array_header_1_0(
            file, {"descr": "<f4", "fortran_order": False, "shape": (3, 99999, 99999)})
        file.write(b"\0" * 64)
    message = refused(capsys, "--images", str(tmp_path))
    assert str(path) in message and "claims a float32 array of shape (3, 99999, 99999)" in message
    assert "the file holds 192 bytes" in message

"""ImageFolderDataset: labeled / unlabeled layouts and the clear errors for bad data."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from ssl_lightning.data import CorruptImageError, ImageFolderDataset
from ssl_lightning.data.datasets import load_image


def test_labeled_folder_gives_sorted_classes_and_targets(tiny_image_folder: Path) -> None:
    dataset = ImageFolderDataset(tiny_image_folder / "train", labeled=True)
    assert dataset.classes == ["class_0", "class_1"]
    assert len(dataset) == 24 and dataset.targets == [0] * 12 + [1] * 12
    image, target = dataset[13]
    assert isinstance(image, Image.Image) and image.size == (32, 32) and target == 1
    assert Path(dataset.samples[13][0]).parent.name == "class_1"


def test_unlabeled_flat_folder_and_ignored_class_folders(
    tmp_path: Path, tiny_image_folder: Path, make_image_folder
) -> None:
    flat = make_image_folder(tmp_path / "flat", classes=1, per_class=5) / "class_0"
    dataset = ImageFolderDataset(flat)  # auto-detected: loose images -> unlabeled
    assert not dataset.labeled and len(dataset) == 5 and set(dataset.targets) == {-1}
    ignored = ImageFolderDataset(tiny_image_folder / "train", labeled=False)
    assert len(ignored) == 24 and set(ignored.targets) == {-1} and ignored.classes == []
    assert ImageFolderDataset(tiny_image_folder / "train").labeled  # auto: class folders only


def test_transform_is_applied(tiny_image_folder: Path) -> None:
    dataset = ImageFolderDataset(tiny_image_folder / "test", transform=lambda im: im.size)
    assert dataset[0] == ((32, 32), 0)


def test_missing_directory_names_the_path_and_the_hint(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match=f"{missing} does not exist. Get it by X"):
        ImageFolderDataset(missing, hint="Get it by X")


def test_file_instead_of_directory(tmp_path: Path) -> None:
    path = tmp_path / "file.txt"
    path.write_text("x")
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        ImageFolderDataset(path)


def test_empty_directory_says_no_images_and_expected_layout(tmp_path: Path) -> None:
    (tmp_path / "empty" / "class_a").mkdir(parents=True)
    (tmp_path / "empty" / "class_a" / "notes.txt").write_text("not an image")
    with pytest.raises(FileNotFoundError, match=r"No images .* found in .*empty.*<class>/<image>"):
        ImageFolderDataset(tmp_path / "empty", labeled=True)
    (tmp_path / "flat").mkdir()
    with pytest.raises(FileNotFoundError, match=r"No images .*flat/<image>"):
        ImageFolderDataset(tmp_path / "flat", labeled=False)


def test_labeled_without_class_folders_is_an_error(tmp_path: Path, make_image_folder) -> None:
    flat = make_image_folder(tmp_path, classes=1, per_class=3) / "class_0"
    with pytest.raises(FileNotFoundError, match="<class>/<image>"):
        ImageFolderDataset(flat, labeled=True)


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_image_error_names_the_file(tmp_path: Path, make_image_folder, damage) -> None:
    root = make_image_folder(tmp_path / "data", classes=1, per_class=3)
    bad = root / "class_0" / "001.jpg"
    data = bad.read_bytes()
    bad.write_bytes(b"this is not a jpeg" if damage == "garbage" else data[: len(data) // 2])
    dataset = ImageFolderDataset(root)
    dataset[0]  # the intact images still load
    with pytest.raises(CorruptImageError, match=f"Cannot read image file {bad}"):
        dataset[1]
    with pytest.raises(CorruptImageError):
        load_image(bad)


def test_symlink_loops_and_duplicate_links_list_each_real_file_once(
    tmp_path: Path, make_image_folder
) -> None:
    flat = make_image_folder(tmp_path / "flat", classes=1, per_class=3) / "class_0"
    (flat / "sub").mkdir()
    (flat / "sub" / "loop").symlink_to("..", target_is_directory=True)
    (flat / "again.jpg").symlink_to(flat / "001.jpg")
    (flat / "same_dir").symlink_to(flat / "sub", target_is_directory=True)
    dataset = ImageFolderDataset(flat)
    assert [Path(p).name for p, _ in dataset.samples] == ["000.jpg", "001.jpg", "002.jpg"]
    labeled = make_image_folder(tmp_path / "labeled", classes=2, per_class=2)
    (labeled / "class_0" / "up").symlink_to("..", target_is_directory=True)
    (labeled / "root_link").symlink_to(".", target_is_directory=True)
    dataset = ImageFolderDataset(labeled)
    assert dataset.classes == ["class_0", "class_1"] and dataset.targets == [0, 0, 1, 1]

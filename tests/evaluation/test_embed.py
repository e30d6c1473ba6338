"""``embed``: every image of a folder, in order, in every format, equal to the model's features."""

from __future__ import annotations

import csv
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from disk_utils import small_tmpfs
from evaluation_helpers import simclr_checkpoint

from ssl_lightning.backbones import SmallConvNet
from ssl_lightning.cli import main as cli_main
from ssl_lightning.data import EvalTransform, ImageFolderDataset
from ssl_lightning.evaluation.embed_writers import read_sidecar


@pytest.fixture(scope="module")
def embedded(tmp_path_factory, make_image_folder):
    """A SimCLR checkpoint, a labelled folder (2 classes x 5 plus one corrupt file) and the
    reference features computed directly with the checkpoint's backbone."""
    root = tmp_path_factory.mktemp("embed")
    folder = make_image_folder(root / "images", classes=2, per_class=5)
    (folder / "class_1" / "broken.jpg").write_bytes(b"not a jpeg")
    ckpt = str(root / "simclr.ckpt")
    model = simclr_checkpoint(SmallConvNet((8, 16)), ckpt, view_size=32, steps=1)
    dataset = ImageFolderDataset(folder)
    good = [(p, y) for p, y in dataset.samples if not p.endswith("broken.jpg")]
    transform = EvalTransform("cifar")
    from PIL import Image

    with torch.no_grad():
        images = torch.stack([transform(Image.open(p).convert("RGB")) for p, _ in good])
        reference = model.backbone.eval()(images).numpy()
    return ckpt, folder, good, reference


def _read(path: Path) -> tuple[list[str], np.ndarray, np.ndarray]:
    if path.suffix == ".npy":
        paths, labels = read_sidecar(path)
        return paths, labels, np.load(path)
    if path.suffix == ".csv":
        rows = list(csv.reader(path.open(newline="", encoding="utf-8")))[1:]
        return ([r[0] for r in rows], np.array([int(r[1]) for r in rows]),
                np.array([[float(v) for v in r[2:]] for r in rows]))
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(path).to_pydict()
        return table["path"], np.array(table["label"]), np.array(table["embedding"])
    data = torch.load(path, weights_only=True)
    return data["paths"], data["labels"].numpy(), data["embeddings"].numpy()


@pytest.mark.parametrize("suffix", [".npy", ".csv", ".parquet", ".pt"])
def test_embed_writes_every_readable_image_in_order(embedded, tmp_path, suffix, capsys):
    ckpt, folder, good, reference = embedded
    out = tmp_path / f"emb{suffix}"
    cli_main(["embed", "--checkpoint", ckpt, "--images", str(folder), "--output", str(out),
              "--batch-size", "3"])
    paths, labels, embeddings = _read(out)
    assert paths == [p for p, _ in good]
    assert labels.tolist() == [y for _, y in good]
    np.testing.assert_allclose(embeddings, reference, rtol=0, atol=1e-6)
    assert "broken.jpg" in Path(f"{out}.skipped.txt").read_text()
    assert "Skipped 1 unreadable" in capsys.readouterr().out


@pytest.mark.slow
def test_embed_on_two_processes_keeps_order_without_duplicates(embedded, tmp_path):
    ckpt, folder, good, reference = embedded
    out = tmp_path / "emb.npy"
    cli_main(["embed", "--checkpoint", ckpt, "--images", str(folder), "--output", str(out),
              "--devices", "2", "--batch-size", "2"])
    paths, _, embeddings = _read(out)
    assert paths == [p for p, _ in good]
    np.testing.assert_allclose(embeddings, reference, rtol=0, atol=1e-6)


def test_embed_bad_input_is_a_clear_error(embedded, tmp_path, capsys):
    ckpt, folder, _, _ = embedded
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [
        (["--images", str(empty), "--output", str(tmp_path / "e.npy")], "No images"),
        (["--images", str(folder), "--output", str(tmp_path / "e.txt")],
         "Unsupported output suffix '.txt'"),
        (["--images", str(folder), "--output", str(tmp_path / "e.npy"), "--on-error", "raise"],
         "broken.jpg"),
    ]
    for args, message in cases:
        with pytest.raises(SystemExit) as exit_info:
            cli_main(["embed", "--checkpoint", ckpt, *args])
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "e.npy").exists()  # no partial output left behind


def _embed(ckpt: str, images: Path | str, output: Path | str, *args: str) -> None:
    cli_main(["embed", "--checkpoint", ckpt, "--images", str(images), "--output", str(output),
              *args])


def test_a_refused_output_leaves_an_existing_file_byte_identical(embedded, tmp_path, capsys):
    ckpt, folder, _, _ = embedded
    victim = tmp_path / "victim.ckpt"
    victim.write_bytes(b"a training checkpoint")
    own = tmp_path / "own.pt"  # the checkpoint itself as a .pt output
    shutil.copyfile(ckpt, own)
    for output, message in ((victim, "Unsupported output suffix '.ckpt'"),
                            (own, "is the checkpoint")):
        before = output.read_bytes()
        with pytest.raises(SystemExit) as exit_info:
            _embed(str(own), folder, output)
        assert exit_info.value.code == 2 and message in capsys.readouterr().err
        assert output.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["own.pt", "victim.ckpt"]


@pytest.mark.parametrize("suffix", [".npy", ".csv", ".pt"])
def test_an_error_mid_run_leaves_a_previous_output_untouched(embedded, tmp_path, suffix, capsys):
    ckpt, folder, _, _ = embedded
    out = tmp_path / f"emb{suffix}"
    _embed(ckpt, folder, out)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(SystemExit):  # stops at broken.jpg, after the readable images
        _embed(ckpt, folder, out, "--on-error", "raise", "--batch-size", "2")
    assert "broken.jpg" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """A directory on a 1 MiB tmpfs with no space left."""
    with small_tmpfs(tmp_path / "full") as mount_point:
        with open(mount_point / "filler", "wb", buffering=0) as filler:
            try:
                while True:
                    filler.write(b"\0" * 4096)
            except OSError:  # full
                pass
        yield mount_point


def test_embed_on_a_full_disk_is_a_clear_error_and_leaves_no_output(embedded, full_disk,
                                                                     capsys):
    ckpt, folder, _, _ = embedded
    out = full_disk / "emb.npy"
    with pytest.raises(SystemExit) as exit_info:
        _embed(ckpt, folder, out)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert "No space left on device" in err and "emb.npy" in err
    assert [p.name for p in full_disk.iterdir()] == ["filler"]


#: File names a tab- or line-separated sidecar cannot hold.
AWKWARD_NAMES = ["tab\there.jpg", "new\nline.jpg", 'quo"te.jpg', "com,ma.jpg", "ünï çødé.jpg",
                 "cr\rlf.jpg", "plain.jpg"]


@pytest.mark.parametrize("suffix", [".npy", ".csv"])
def test_paths_with_separators_read_back_as_written(embedded, tmp_path, suffix):
    ckpt, folder, good, _ = embedded
    images = tmp_path / "awkward" / "class_0"
    images.mkdir(parents=True)
    for name in AWKWARD_NAMES:
        shutil.copyfile(good[0][0], images / name)
    out = tmp_path / f"emb{suffix}"
    _embed(ckpt, images.parent, out)
    paths, labels, embeddings = _read(out)
    assert paths == [p for p, _ in ImageFolderDataset(images.parent).samples]
    assert sorted(Path(p).name for p in paths) == sorted(AWKWARD_NAMES)
    assert labels.tolist() == [0] * len(AWKWARD_NAMES) and len(embeddings) == len(paths)


def test_a_torchvision_backbone_named_in_the_config_is_rebuilt_from_the_checkpoint(run_config):
    """A class that records nothing itself (torchvision's) gets the config's spec via the CLI."""
    from ssl_lightning.evaluation.checkpoint import backbone_from_checkpoint

    cli = run_config(Path(__file__).resolve().parents[2] / "configs" / "simclr.yaml",
                     ["--model.init_args.backbone", "torchvision.models.mobilenet_v3_small",
                      "--model.init_args.backbone.init_args.num_classes", "32",
                      "--model.init_args.projection_hidden_dim", "16"])
    path = str(Path(cli.trainer.default_root_dir) / "m.ckpt")
    cli.trainer.save_checkpoint(path)
    rebuilt = backbone_from_checkpoint(path)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(rebuilt.eval()(x), cli.model.backbone.eval()(x))


@pytest.mark.parametrize("suffix", [".npy", ".parquet", ".pt"])
def test_patch_features_are_one_map_per_image(embedded, tmp_path, suffix, capsys):
    """``--patch-features``: a row per readable image holding its (h, w, C) map, channels last
    (flattened in that order in .parquet, whose metadata records the shape)."""
    from PIL import Image

    from ssl_lightning.evaluation.checkpoint import backbone_from_checkpoint

    ckpt, folder, good, _ = embedded
    out = tmp_path / f"patches{suffix}"
    cli_main(["embed", "--checkpoint", ckpt, "--images", str(folder), "--output", str(out),
              "--batch-size", "4", "--patch-features"])
    assert "embeddings of size 8x8x16" in capsys.readouterr().out  # 32 px, two stride-2 convs
    paths, labels, embeddings = _read(out)
    assert paths == [p for p, _ in good] and len(embeddings) == len(good) == 10
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        assert pq.read_schema(out).metadata[b"row_shape"] == b"8,8,16"
        embeddings = embeddings.reshape(len(good), 8, 8, 16)
    assert embeddings.shape == (10, 8, 8, 16)
    transform = EvalTransform("cifar")
    backbone = backbone_from_checkpoint(ckpt).eval()
    with torch.no_grad():
        images = torch.stack([transform(Image.open(p).convert("RGB")) for p, _ in good])
        reference = backbone.forward_features(images).permute(0, 2, 3, 1).numpy()
    np.testing.assert_allclose(embeddings, reference, rtol=0, atol=1e-6)


def test_the_skipped_list_says_why_each_file_was_skipped(embedded, tmp_path):
    ckpt, folder, _, _ = embedded
    out = tmp_path / "emb.npy"
    _embed(ckpt, folder, out)
    path, reason = Path(f"{out}.skipped.txt").read_text().splitlines()[0].split("\t")
    assert path.endswith("broken.jpg")
    assert reason.startswith(f"Cannot read image file {path}: cannot identify image file")


def test_a_folder_of_nothing_readable_is_an_error_that_writes_nothing(embedded, tmp_path,
                                                                       capsys):
    ckpt, _, _, _ = embedded
    for c in range(2):
        (tmp_path / "tiffs" / f"class_{c}").mkdir(parents=True)
        (tmp_path / "tiffs" / f"class_{c}" / "a.tif").write_bytes(b"II*\0 13 bands, not RGB")
    with pytest.raises(SystemExit) as exit_info:
        _embed(ckpt, tmp_path / "tiffs", tmp_path / "emb.parquet")
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and err[-1].startswith(
        "embed: error: none of the 2 images under") and "--image-reader array" in err[-1]
    assert not list(tmp_path.glob("emb*"))


def test_split_folders_get_a_warning_naming_the_labels(embedded, tiny_image_folder, tmp_path):
    ckpt, _, _, _ = embedded
    with pytest.warns(UserWarning, match=r"folders test, train, which look like splits .* "
                                          r"\(0 = test, 1 = train\)"):
        _embed(ckpt, tiny_image_folder, tmp_path / "emb.npy")

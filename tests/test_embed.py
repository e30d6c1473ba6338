"""``embed``: every image of a folder, in order, in every format, equal to the model's features."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest
import torch
from evaluation_helpers import simclr_checkpoint

from ssl_lightning.backbones import SmallConvNet
from ssl_lightning.cli import main as cli_main
from ssl_lightning.data import EvalTransform, ImageFolderDataset


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
        lines = Path(f"{path}.paths.tsv").read_text().splitlines()
        return ([line.split("\t")[0] for line in lines],
                np.array([int(line.split("\t")[1]) for line in lines]), np.load(path))
    if path.suffix == ".csv":
        rows = list(csv.reader(path.open()))[1:]
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


def test_a_torchvision_backbone_named_in_the_config_is_rebuilt_from_the_checkpoint(run_config):
    """A class that records nothing itself (torchvision's) gets the config's spec via the CLI."""
    from ssl_lightning.evaluation.checkpoint import backbone_from_checkpoint

    cli = run_config(Path(__file__).resolve().parents[1] / "configs" / "simclr.yaml",
                     ["--model.init_args.backbone", "torchvision.models.mobilenet_v3_small",
                      "--model.init_args.backbone.init_args.num_classes", "32",
                      "--model.init_args.projection_hidden_dim", "16"])
    path = str(Path(cli.trainer.default_root_dir) / "m.ckpt")
    cli.trainer.save_checkpoint(path)
    rebuilt = backbone_from_checkpoint(path)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(rebuilt.eval()(x), cli.model.backbone.eval()(x))

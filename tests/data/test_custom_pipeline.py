"""A custom per-view augmentation pipeline from YAML (docs/examples/custom_views.yaml)."""

from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image
from torchvision.transforms import v2

from ssl_lightning.data import MultiViewTransform

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "docs" / "examples" / "custom_views.yaml"


def test_yaml_pipeline_builds_the_documented_transforms_and_trains(run_config):
    cli = run_config(ROOT / "configs" / "simclr.yaml", ["--config", str(EXAMPLE)])
    assert cli.trainer.state.finished and cli.trainer.global_step == 1
    views = cli.datamodule.train_transform
    assert isinstance(views, MultiViewTransform) and views.num_views == 2
    first = views.transforms[0].transforms
    assert [type(t) for t in first] == [
        v2.RandomResizedCrop, v2.RandomChoice, v2.RandomOrder, v2.ToImage, v2.ToDtype,
        v2.Normalize]
    assert first[4].dtype == torch.float32
    image = Image.new("RGB", (40, 40), (200, 30, 60))
    out = views(image)
    assert [tuple(v.shape) for v in out] == [(3, 32, 32), (3, 32, 32)]
    assert all(v.dtype == torch.float32 for v in out)


def test_random_choice_applies_exactly_one_of_its_transforms():
    grey = v2.RandomGrayscale(p=1.0)
    invert = v2.RandomInvert(p=1.0)
    choice = v2.RandomChoice([grey, invert])
    image = v2.ToImage()(Image.new("RGB", (4, 4), (200, 30, 60)))
    seen = set()
    for seed in range(20):
        torch.manual_seed(seed)
        out = choice(image)
        is_grey = bool((out[0] == out[1]).all())
        is_inverted = bool((out == 255 - image).all())
        assert is_grey != is_inverted  # one, never both or neither
        seen.add(is_grey)
    assert seen == {True, False}

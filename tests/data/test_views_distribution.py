"""The batched ``DeviceViews`` draw the same distribution of views as the per-image
``SimCLRViews`` (torchvision v2) for the same recipe.

Two checks, both with fixed seeds (so deterministic) and two-sample tests at a per-test level
of 1e-4 (Bonferroni-style for the ~100 comparisons here; a fresh seed would fail with
probability ~1 %):

- the recorded random *parameters*: torchvision's draws are read off each transform's
  ``make_params`` (called only when a random-apply transform fires), ours off
  :meth:`DeviceViews.draw_params` on the seeded path the loaders run. Crop area, log aspect
  ratio and offsets, the RandomResizedCrop fallback's share, jitter factors and hue, the
  permutation of the four jitter operations, blur sigma (KS or chi-square), and the rates of
  flip, jitter, grayscale, blur and solarisation;
- per-view summary statistics of the *views themselves* on structured images (channel means,
  luma spread, sharpness, left/right and top/bottom balance, colourfulness): covers the
  operations' kernels and their order, the resampling and the normalisation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from scipy import stats
from torchvision.transforms import v2

from ssl_lightning.data import CIFAR10DataModule, DeviceViews, SimCLRViews
from ssl_lightning.data.seeding import sample_seed

ROOT = Path(__file__).resolve().parents[2]
ALPHA = 1e-4
DRAWS = 2000


#: Tiny tensors: one intra-op thread is faster (and fair to a shared machine).
pytestmark = pytest.mark.usefixtures("one_thread")

# (recipe, image height, width): CIFAR as the configs (simclr, dcl, supcon, moco_v2; simsiam's
# crop scale), the ImageNet recipe (blur, s=1) at 32 px on non-square images with
# solarisation, and an elongated image on which most crops take the fallback.
RECIPES: dict[str, tuple[dict[str, Any], int, int]] = {
    "cifar": ({"preset": "cifar"}, 32, 32),
    "simsiam": ({"preset": "cifar", "crop_scale": (0.2, 1.0)}, 32, 32),
    "imagenet_blur_solarize": ({"preset": "imagenet", "crop_size": 32, "solarize_p": 0.2}, 40, 56),
    "fallback": ({"preset": "cifar", "crop_size": 16, "crop_scale": (0.25, 1.0)}, 16, 64),
}


def _record(transform: Any, name: str, log: dict[str, dict[str, Any]]) -> None:
    """Log the parameters ``transform`` draws; skip its kernel (the parameters depend only on
    the image size, and no step after the crop draws size-dependent ones)."""
    original = transform.make_params

    def make_params(flat_inputs: list[Any]) -> dict[str, Any]:
        log[name] = params = original(flat_inputs)
        return params

    transform.make_params = make_params
    transform.transform = lambda inpt, params: inpt


def torchvision_params(views: SimCLRViews, height: int, width: int, n: int) -> dict[str, Any]:
    """Parameters drawn by ``n`` calls of the SimCLRViews pipeline on a height x width image."""
    pipeline = views.transforms[0]
    log: dict[str, dict[str, Any]] = {}
    for step in pipeline.transforms:
        inner = step.transforms if isinstance(step, v2.RandomApply) else [step]
        for t in inner:
            if isinstance(t, v2.Transform):
                _record(t, type(t).__name__, log)
    image = v2.functional.to_pil_image(torch.randint(0, 256, (3, height, width),
                                                     dtype=torch.uint8))
    rows: dict[str, list[Any]] = {k: [] for k in ("box", "flip", "jitter", "factors", "hue",
                                                  "order", "gray", "sigma", "solarize")}
    torch.manual_seed(0)
    for _ in range(n):
        log.clear()
        pipeline(image)
        crop = log["RandomResizedCrop"]
        rows["box"].append([crop["left"], crop["top"], crop["left"] + crop["width"],
                            crop["top"] + crop["height"]])
        rows["flip"].append("RandomHorizontalFlip" in log)
        jitter = log.get("ColorJitter")
        rows["jitter"].append(jitter is not None)
        if jitter is not None:
            rows["factors"].append([jitter[f"{k}_factor"] for k in
                                    ("brightness", "contrast", "saturation")])
            rows["hue"].append(jitter["hue_factor"])
            rows["order"].append(jitter["fn_idx"].tolist())
        rows["gray"].append("RandomGrayscale" in log)
        rows["sigma"].append(log["GaussianBlur"]["sigma"][0] if "GaussianBlur" in log else 0.0)
        rows["solarize"].append("RandomSolarize" in log)
    return {k: np.array(v, dtype=float) for k, v in rows.items()}


def device_params(views: DeviceViews, height: int, width: int, n: int) -> dict[str, Any]:
    """Parameters drawn by DeviceViews for ``n`` samples with per-sample seeds."""
    drawn = []
    original = views.apply

    def apply(x: torch.Tensor, params: Any) -> torch.Tensor:
        drawn.append(params)
        return original(x, params)

    views.apply = apply  # type: ignore[method-assign]
    images = torch.randint(0, 256, (1, 3, height, width), dtype=torch.uint8).expand(n, -1, -1, -1)
    seeds = torch.tensor([sample_seed(0, 0, i) for i in range(n)])
    views(images.contiguous(), seeds=seeds)
    p = drawn[0]
    jitter = p.jitter
    return {"box": p.boxes.numpy().astype(float), "flip": p.flip.numpy(),
            "jitter": jitter.numpy(), "factors": p.factors[jitter].numpy(),
            "hue": p.hue[jitter].numpy(), "order": p.order[jitter].numpy(),
            "gray": p.gray.numpy(), "sigma": p.blur_sigma.numpy(),
            "solarize": p.solarize.numpy()}


def _rate_p(a: np.ndarray, b: np.ndarray) -> float:
    table = np.array([[a.sum(), len(a) - a.sum()], [b.sum(), len(b) - b.sum()]])
    if (table[:, 0] == 0).all() or (table[:, 1] == 0).all():
        return 1.0  # the same constant in both
    return float(stats.chi2_contingency(table)[1])


def _permutations_p(a: np.ndarray, b: np.ndarray) -> float:
    """Chi-square test of two samples of permutations of 0..3 (rows)."""
    codes = [s @ 4 ** np.arange(4) for s in (a, b)]
    keys = np.unique(np.concatenate(codes))
    table = np.array([[(c == k).sum() for k in keys] for c in codes])
    return float(stats.chi2_contingency(table)[1])


def compare_params(ref: dict[str, Any], ours: dict[str, Any], height: int,
                   width: int) -> dict[str, float]:
    """p-values of the two-sample tests, one per parameter."""
    p: dict[str, float] = {}
    for params in (ref, ours):
        x0, y0, x1, y1 = params["box"].T
        params["area"] = (x1 - x0) * (y1 - y0) / (height * width)
        params["log_ratio"] = np.log((x1 - x0) / (y1 - y0))
        params["x0"], params["y0"] = x0, y0
    # The fallback box is the most frequent one by far where tries fail often.
    boxes, counts = np.unique(ref["box"], axis=0, return_counts=True)
    mode = boxes[counts.argmax()]
    for key in ("flip", "jitter", "gray", "solarize"):
        p[key] = _rate_p(ref[key].astype(bool), ours[key].astype(bool))
    p["blur"] = _rate_p(ref["sigma"] > 0, ours["sigma"] > 0)
    p["mode_box"] = _rate_p((ref["box"] == mode).all(1), (ours["box"] == mode).all(1))
    for key in ("area", "log_ratio", "x0", "y0", "hue"):
        p[key] = float(stats.ks_2samp(ref[key], ours[key]).pvalue)
    for i, key in enumerate(("brightness", "contrast", "saturation")):
        p[key] = float(stats.ks_2samp(ref["factors"][:, i], ours["factors"][:, i]).pvalue)
    if (ref["sigma"] > 0).any() or (ours["sigma"] > 0).any():
        p["sigma"] = float(stats.ks_2samp(ref["sigma"][ref["sigma"] > 0],
                                          ours["sigma"][ours["sigma"] > 0]).pvalue)
    p["order"] = _permutations_p(ref["order"], ours["order"])
    return p


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_same_parameter_distributions(recipe: str) -> None:
    kwargs, height, width = RECIPES[recipe]
    ref = torchvision_params(SimCLRViews(num_views=1, **kwargs), height, width, DRAWS)
    ours = device_params(DeviceViews(num_views=1, **kwargs), height, width, DRAWS)
    p = compare_params(ref, ours, height, width)
    assert min(p.values()) > ALPHA, {k: v for k, v in p.items() if v <= ALPHA}


def structured_images(height: int, width: int) -> torch.Tensor:
    """Three uint8 images with colour ramps, a bright off-centre disc and texture."""
    y, x = torch.meshgrid(torch.linspace(0, 1, height), torch.linspace(0, 1, width),
                          indexing="ij")
    disc = (((x - 0.7) ** 2 + (y - 0.3) ** 2) < 0.05).float()
    checker = ((torch.arange(width) // 3 + torch.arange(height).view(-1, 1) // 3) % 2).float()
    images = [
        torch.stack([x, y, 1 - x * y]),
        torch.stack([0.2 + 0.6 * disc, 0.3 + 0.4 * x, 0.5 * checker + 0.2 * y]),
        torch.stack([checker * 0.8, disc * 0.9 + 0.05, 0.4 * x + 0.3 * checker]),
    ]
    return (torch.stack(images) * 255).round().to(torch.uint8)


def view_statistics(views: torch.Tensor, mean: Any, std: Any) -> np.ndarray:
    """(n, 8) per-view statistics of normalised views (n, 3, h, w)."""
    x = views * torch.tensor(std).view(1, 3, 1, 1) + torch.tensor(mean).view(1, 3, 1, 1)
    luma = (0.299 * x[:, 0] + 0.587 * x[:, 1] + 0.114 * x[:, 2])
    half_w, half_h = x.shape[3] // 2, x.shape[2] // 2
    columns = [
        *x.mean((2, 3)).T,  # channel means
        luma.std((1, 2)),  # contrast
        (luma[:, :, 1:] - luma[:, :, :-1]).abs().mean((1, 2)),  # sharpness / zoom
        luma[:, :, :half_w].mean((1, 2)) - luma[:, :, half_w:].mean((1, 2)),  # flip, x offset
        luma[:, :half_h].mean((1, 2)) - luma[:, half_h:].mean((1, 2)),  # y offset
        (x.amax(1) - x.amin(1)).mean((1, 2)),  # colourfulness: saturation, grayscale
    ]
    return torch.stack(columns, 1).numpy()


def compare_views(kwargs: dict[str, Any], height: int, width: int, n: int) -> list[float]:
    """KS p-values of the view statistics, per image and statistic."""
    reference, ours = SimCLRViews(num_views=1, **kwargs), DeviceViews(num_views=1, **kwargs)
    pvalues = []
    torch.manual_seed(0)
    for k, image in enumerate(structured_images(height, width)):
        pil = v2.functional.to_pil_image(image)
        ref_views = torch.stack([reference(pil)[0] for _ in range(n)])
        seeds = torch.tensor([sample_seed(1, k, i) for i in range(n)])
        our_views = ours(image.expand(n, -1, -1, -1).contiguous(), seeds=seeds)[0]
        a = view_statistics(ref_views, ours.mean, ours.std)
        b = view_statistics(our_views, ours.mean, ours.std)
        pvalues += [float(stats.ks_2samp(a[:, j], b[:, j]).pvalue) for j in range(a.shape[1])]
    return pvalues


@pytest.mark.parametrize("recipe", ["cifar", "imagenet_blur_solarize"])
def test_same_distribution_of_view_statistics(recipe: str) -> None:
    kwargs, height, width = RECIPES[recipe]
    pvalues = compare_views(kwargs, height, width, n=500)
    assert min(pvalues) > ALPHA, pvalues


SIMCLR_RECIPE_CONFIGS = ["simclr", "dcl", "supcon", "moco_v2", "simsiam"]


@pytest.mark.parametrize("name", SIMCLR_RECIPE_CONFIGS)
def test_simclr_recipe_configs_ship_a_tested_batched_recipe(name: str) -> None:
    """The configs' DeviceViews arguments are a recipe tested above, made where "auto" says."""
    config = yaml.safe_load((ROOT / "configs" / f"{name}.yaml").read_text())
    data = config["data"]["init_args"]
    assert "train_transform" not in data  # the data module's UInt8Image: decode only
    assert data["batched_views_on"] == "auto"
    assert data["device_transform"]["class_path"] == "DeviceViews"
    args = {k: tuple(v) if isinstance(v, list) else v
            for k, v in data["device_transform"]["init_args"].items()}
    assert args in [RECIPES["cifar"][0], RECIPES["simsiam"][0]], args


def test_auto_makes_the_views_in_the_loader_without_an_accelerator(
        tiny_image_folder: Path) -> None:
    """"auto" without a trainer (or on CPU): the loader yields the normalised float views."""
    dm = CIFAR10DataModule(root=str(tiny_image_folder), batch_size=4, num_workers=0,
                           device_transform=DeviceViews("cifar"))
    views, targets, _ = next(iter(dm.train_dataloader()))
    assert len(views) == 2 and views[0].shape == (4, 3, 32, 32)
    assert views[0].dtype == torch.float32 and targets.shape == (4,)
    assert dm.on_after_batch_transfer((views, targets), 0) == (views, targets)


def test_a_view_making_train_transform_with_a_device_transform_is_refused() -> None:
    with pytest.raises(ValueError, match="device_transform: null"):
        CIFAR10DataModule(train_transform=SimCLRViews(), device_transform=DeviceViews())

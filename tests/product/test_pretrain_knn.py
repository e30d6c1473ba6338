"""``benchmarks/pretrain_knn.py`` takes its methods from the registry: every registered method
resolves to a recipe (tuned or default) of its class with its views, and ``--tiny`` trains one
step end to end, in-process, for every one."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ssl_lightning.data.transforms import MultiViewTransform
from ssl_lightning.methods.registry import method_entries

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import pretrain_knn  # noqa: E402


@pytest.fixture(scope="module")
def args():
    return pretrain_knn.parse_args(["--widths", "8", "16"])


def _views(name: str) -> int:
    """Views per image the benchmark makes for ``name``."""
    views = pretrain_knn.build_views(name)
    device = views.get("device_transform")
    if device is not None:
        return device.num_views + device.weak_views
    transform = views["train_transform"]
    assert isinstance(transform, MultiViewTransform)
    return len(transform.transforms)


def test_every_registered_method_resolves_to_a_recipe_of_its_class(args) -> None:
    """Every registry name is a ``--method`` choice and builds its class, with the registry
    entry's number of views unless a tuned recipe sets its own."""
    names = pretrain_knn.method_names()
    for entry in method_entries():
        assert entry.name in names, f"{entry.name} is not a --method choice"
        model = pretrain_knn.build_method(entry.name, args)
        assert type(model) is entry.cls, (entry.name, type(model))
        if entry.name not in pretrain_knn.RECIPES:
            assert _views(entry.name) == len(entry.views), entry.name


def test_recipes_and_variants_name_registered_methods() -> None:
    registered = {entry.name for entry in method_entries()}
    assert set(pretrain_knn.VARIANTS.values()) <= registered
    assert set(pretrain_knn.VARIANTS) <= set(pretrain_knn.RECIPES), "a variant needs a recipe"
    for name in pretrain_knn.RECIPES:
        assert pretrain_knn.registry_name(name) in registered, f"recipe {name!r} is not registered"


#: Tuned recipes whose published settings need more than ``--tiny``'s 20 images of batch 16:
#: the run stops with this one-line error before any step.
TOO_BIG_FOR_TINY = {
    "deepcluster_v2": "asks for more clusters than the 20 training samples",
    "wmse": "needs a global batch .* of >= 128",
}


@pytest.mark.parametrize("method", pretrain_knn.method_names())
def test_tiny_run_trains_one_step(method: str) -> None:
    """Every ``--method`` choice (each registered method and variant) trains one step on
    synthetic images and measures kNN (about 0.5 s each on one CPU thread)."""
    argv = ["--tiny", "--method", method, "--widths", "8", "16"]
    if method in TOO_BIG_FOR_TINY:
        with pytest.raises(ValueError, match=TOO_BIG_FOR_TINY[method]):
            pretrain_knn.main(argv)
        return
    result = pretrain_knn.main(argv)
    assert result["steps"] == 1
    assert 0 <= result["pretrained_knn_top1"] <= 100

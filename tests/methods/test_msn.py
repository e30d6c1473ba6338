"""MSN (Assran et al., ECCV 2022) behaviour: the anchor view's tokens are dropped per sample from
its key (the same for any batch layout, the focal views and the target unmasked), the teacher
sees the unmasked target view without stochastic depth, the prototypes get no weight decay and
no clipping, the step outputs have the shapes the loss expects, and bad settings fail in
``__init__`` or at the first step with a message naming the value."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from multicrop_utils import msn_views, small_msn
from torch import Tensor

from ssl_lightning.backbones import SmallConvNet, ViT
from ssl_lightning.backbones.vit import DropPath
from ssl_lightning.methods import MSN
from ssl_lightning.training.sample_rng import SampleKeys, keyed_forward


def _vit(**kw: Any) -> ViT:
    return ViT(image_size=16, patch_size=4, embed_dim=16, depth=2, num_heads=2, **kw)


def _keys(seeds: Tensor, world: int = 1, rank: int = 0) -> SampleKeys:
    return SampleKeys.from_seeds(seeds, rng_seed=3, rank=rank, world_size=world, step_seed=5)


def test_step_outputs_have_the_loss_shapes() -> None:
    model = small_msn()
    out = model.forward_views(msn_views())
    assert out["anchors"].shape == (4, 3, 8)  # anchor + 2 focal views
    assert out["targets"].shape == (4, 8) and not out["targets"].requires_grad
    assert out["features"].shape == (4, 16)
    loss = model.loss_from_outputs(out)
    loss.backward()
    assert model.prototypes.weight.grad is not None and loss.ndim == 0


def test_only_the_anchor_view_is_masked_with_keys_of_its_samples() -> None:
    model = small_msn()
    seen: list[int] = []  # per call: minus the kept tokens, or the side of unmasked crops
    vit = model.backbone
    real = vit.forward_tokens

    def record(x: Tensor, keep: Tensor | None = None, **kw: Any) -> Tensor:
        seen.append(x.shape[-1] if keep is None else -keep.shape[1])
        return real(x, keep=keep, **kw)

    vit.forward_tokens = record  # type: ignore[method-assign]
    model.forward_views(msn_views())
    assert seen == [-12, 8]  # anchor: 12 of 16 tokens kept; focal views (8 px) whole
    seeds = torch.arange(6, dtype=torch.int64) * 1000
    with keyed_forward(_keys(seeds)):
        whole = model.draw_keep(6, 16, torch.device("cpu"))
    with keyed_forward(_keys(seeds[3:], world=1)):
        half = model.draw_keep(3, 16, torch.device("cpu"))
    assert torch.equal(whole[3:], half)  # a sample's mask is its own
    assert len({tuple(row.sort().values.tolist()) for row in whole}) > 1


def test_the_teacher_has_no_stochastic_depth_and_follows_the_student() -> None:
    model = small_msn(drop_path_rate=0.3)
    assert all(m.drop_prob == 0.0 for m in model.teacher_backbone.modules()
               if isinstance(m, DropPath))
    assert any(m.drop_prob > 0 for m in model.backbone.modules() if isinstance(m, DropPath))
    students = {id(s) for s, _ in model.ema_pairs()}
    assert students == {id(model.backbone), id(model.projector)}
    assert not any(p.requires_grad for _, t in model.ema_pairs() for p in t.parameters())


def test_prototypes_have_no_weight_decay() -> None:
    model = small_msn()
    groups = model.param_groups()
    prototype_group = [g for g in groups if any(p is model.prototypes.weight
                                                for p in g["params"])]
    assert len(prototype_group) == 1 and prototype_group[0]["weight_decay"] == 0.0
    params = [p for g in groups for p in g["params"]]
    assert len(params) == len({id(p) for p in params}) == sum(
        1 for m in model.trainable_modules() for p in m.parameters() if p.requires_grad)


def test_clip_bounds_the_encoder_gradient_not_the_prototypes() -> None:
    model = small_msn(clip_grad=1e-3, weight_decay_end=None)
    model.loss_from_outputs(model.forward_views(msn_views())).backward()
    prototypes = model.prototypes.weight.grad.clone()
    model.on_before_optimizer_step(torch.optim.SGD(model.parameters(), lr=0.1))
    encoder = [p.grad for m in (model.backbone, model.projector) for p in m.parameters()
               if p.grad is not None]
    assert torch.linalg.vector_norm(torch.stack([g.norm() for g in encoder])) <= 1e-3 + 1e-9
    assert torch.equal(model.prototypes.weight.grad, prototypes)


def test_unmasked_msn_takes_any_backbone() -> None:
    model = MSN(SmallConvNet((4, 8)), projection_hidden_dim=16, projection_dim=8,
                num_prototypes=10, mask_ratio=0.0)
    assert model.forward_views(msn_views())["anchors"].shape == (4, 3, 8)


@pytest.mark.parametrize("kwargs, message", [
    ({"mask_ratio": 1.0}, r"mask_ratio must be in \[0, 1\), got 1.0"),
    ({"mask_ratio": 0.99}, "keeps 0 of 16 patches"),
    ({"clip_grad": 0.0}, "clip_grad must be > 0 or None, got 0.0"),
    ({"temperature": -1.0}, "temperature must be > 0, got -1.0"),
    ({"sharpen_temperature": 2.0}, r"sharpen_temperature must be in \(0, 1\], got 2.0"),
    ({"sinkhorn_iterations": -1}, "sinkhorn_iterations must be >= 0"),
    ({"image_size": 32}, "image_size 32 must be the backbone's image size 16"),
])
def test_bad_settings_fail_in_init(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        small_msn(**kwargs)


def test_a_masked_msn_needs_a_vit_backbone() -> None:
    with pytest.raises(ValueError, match="needs a ViT backbone"):
        MSN(SmallConvNet((4, 8)), projection_hidden_dim=16, projection_dim=8, mask_ratio=0.15)


def test_bad_views_fail_at_the_step() -> None:
    model = small_msn()
    views = msn_views()
    with pytest.raises(ValueError, match="needs 2 views per sample, got 1"):
        model.forward_views(views[:1])
    with pytest.raises(ValueError, match="target and anchor views"):
        model.forward_views([views[0], views[2]])

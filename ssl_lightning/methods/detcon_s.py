"""DetCon-S: Hénaff, Koppula, Alayrac, van den Oord, Vinyals & Carreira, "Efficient Visual
Pretraining with Contrastive Detection", ICCV 2021 (the SimCLR form).

Each view's feature map (``forward_dense``) is average-pooled under the image's segment masks
(:func:`~ssl_lightning.losses.detcon.mask_pool`), each pooled segment goes through the projection
MLP, and the segments are contrasted (:class:`~ssl_lightning.losses.DetConLoss`): a segment's
positive is the same segment in the other view of the same image, its negatives every other
segment of the global batch. The masks (:func:`~ssl_lightning.masking.segments.view_segments`)
are the paper's "spatial heuristic" grid over the original image, placed in each view by its
crop box (``train_transform: LocatedViews``), the paper's Felzenszwalb masks
(``train_transform: FelzenszwalbViews`` with ``sampled_masks: 16``: segments of the original
image cut with each view's crop box, 16 sampled per view from the sample's keys), or the segment
maps the dataset provides after the views; for plain two-view batches the grid lies over each
view itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ssl_lightning._lightning import attached_trainer
from ssl_lightning.backbones.dense import dense_channels, dense_features
from ssl_lightning.backbones.tokens import layout
from ssl_lightning.data.segmented_views import FelzenszwalbViews
from ssl_lightning.data.transforms import MultiViewTransform
from ssl_lightning.heads import build_mlp
from ssl_lightning.losses import DetConLoss
from ssl_lightning.losses.dense_matching import map_to_locations
from ssl_lightning.losses.detcon import mask_pool
from ssl_lightning.masking.segments import view_segments
from ssl_lightning.methods.base import SSLMethod
from ssl_lightning.methods.registry import TWO_VIEWS, Paper, register_method
from ssl_lightning.training.sample_rng import active_keys, keyed_uniform


def check_mask_settings(grid: int, segment_image_size: int, num_segments: int,
                        sampled_masks: int) -> None:
    """One error line for DetCon's mask settings out of range."""
    if grid < 1 or segment_image_size < 1 or num_segments < 1 or sampled_masks < 0:
        raise ValueError(f"grid, segment_image_size and num_segments must be >= 1 and "
                         f"sampled_masks >= 0, got {grid}, {segment_image_size}, {num_segments}, "
                         f"{sampled_masks}.")


def check_mask_transform(module: nn.Module, sampled_masks: int) -> None:
    """Before the first step: sampled masks need segment maps after the views, which the
    package's multi-view transforms other than FelzenszwalbViews do not make."""
    trainer = attached_trainer(module)  # type: ignore[arg-type]
    transform = getattr(getattr(trainer, "datamodule", None), "train_transform", None)
    if sampled_masks > 0 and isinstance(transform, MultiViewTransform) \
            and not isinstance(transform, FelzenszwalbViews):
        raise ValueError(f"{type(module).__name__} with sampled_masks: {sampled_masks} samples "
                         f"among segment maps, but the data's train_transform is "
                         f"{type(transform).__name__}: use train_transform FelzenszwalbViews, "
                         "or sampled_masks: 0 for the grid masks.")


def mask_uniforms(module: nn.Module, batch: int, view: int, masks: int) -> Tensor | None:
    """(B, ``masks``) float64 uniforms that pick view ``view``'s sampled masks: from the samples'
    keys inside a keyed forward (the same on any number of processes and micro-batches), else
    from the CPU stream shared by the ranks; None when no masks are sampled."""
    if masks == 0:
        return None
    keys = active_keys()
    if keys is not None:
        return keyed_uniform(keys.streams(view).cpu(), masks)
    world, rank = layout(module)  # type: ignore[arg-type]
    return torch.rand(world, batch, masks, dtype=torch.float64)[rank]


def pooled_segments(backbone: nn.Module, views: Sequence[Tensor], view: int, grid: int,
                    image_size: int, num_segments: int, uniforms: Tensor | None = None
                    ) -> tuple[Tensor, Tensor, Tensor]:
    """``backbone``'s mask-pooled features (B, K, C) of view ``view``, their ids (B, K) and the
    view's pooled features (B, D), with the masks of
    :func:`~ssl_lightning.masking.segments.view_segments` (sampled ones given ``uniforms``)."""
    feature_map, pooled = dense_features(backbone, views[view])
    height, width = feature_map.shape[2:]
    weights, sampled_ids = view_segments(views, view, height, width, grid, image_size,
                                         num_segments, uniforms)
    segment_features, ids = mask_pool(map_to_locations(feature_map), weights)
    return segment_features, ids if sampled_ids is None else sampled_ids.to(ids.device), pooled


@register_method(
    "detcon_s", title="DetCon-S", configs=("detcon_s.yaml",),
    paper=Paper("Efficient Visual Pretraining with Contrastive Detection", 2021, "2103.10957"),
    family="contrastive", views=TWO_VIEWS, tests="tests/methods/test_detcon_s.py",
    small=lambda backbone, **kw: DetConS(backbone, **{
        "projection_hidden_dim": 16, "projection_dim": 8, "head_batch_norm": False, "grid": 2,
        **kw}),
)
class DetConS(SSLMethod):
    """DetCon-S on two views.

    Args:
        backbone: Feature extractor with a feature map (``forward_dense``).
        projection_hidden_dim: Hidden width of the projection MLP (4096 in the paper).
        projection_dim: Embedding size of each segment (256).
        projection_layers: Linear layers of the projection MLP (2).
        head_batch_norm: BatchNorm in the MLP's hidden layer (off for BatchNorm-free models).
        temperature: τ (0.1).
        grid: Cells per side of the grid masks (4: 16 segments, the paper's 16 masks per image).
        segment_image_size: Side in pixels of the images the crop boxes refer to (32 for the
            CIFAR preset of LocatedViews).
        num_segments: Segments read from dataset-provided segment maps (ids 0..K−1; others are
            ignored).
        sampled_masks: 0: the masks above; M > 0: M masks sampled per view among the segments
            present in it (Felzenszwalb maps of ``FelzenszwalbViews``; the paper's 16).
        **kwargs: Optimiser arguments of :class:`SSLMethod`.
    """

    views_used = None  # the two views and, optionally, their boxes or segment maps

    def __init__(
        self,
        backbone: nn.Module,
        projection_hidden_dim: int = 4096,
        projection_dim: int = 256,
        projection_layers: int = 2,
        head_batch_norm: bool = True,
        temperature: float = 0.1,
        grid: int = 4,
        segment_image_size: int = 32,
        num_segments: int = 16,
        sampled_masks: int = 0,
        **kwargs: Any,
    ) -> None:
        check_mask_settings(grid, segment_image_size, num_segments, sampled_masks)
        super().__init__(backbone, **kwargs)
        self.temperature, self.grid = temperature, grid
        self.segment_image_size, self.num_segments = segment_image_size, num_segments
        self.sampled_masks = sampled_masks
        channels = dense_channels(self.backbone, kwargs.get("image_size", 32))
        self.projector = build_mlp(channels, projection_hidden_dim, projection_dim,
                                   projection_layers, batch_norm=head_batch_norm)

    def build_criterion(self) -> DetConLoss:
        return DetConLoss(self.temperature)

    def on_fit_start(self) -> None:
        super().on_fit_start()
        check_mask_transform(self, self.sampled_masks)

    def segments(self, backbone: nn.Module, views: Sequence[Tensor], view: int
                 ) -> tuple[Tensor, Tensor, Tensor]:
        """See :func:`pooled_segments`, with this method's mask settings."""
        uniforms = mask_uniforms(self, views[0].shape[0], view, self.sampled_masks)
        return pooled_segments(backbone, views, view, self.grid, self.segment_image_size,
                               self.num_segments, uniforms)

    def forward_views(self, views: Sequence[Tensor]) -> dict[str, Any]:
        self.require_views(views)
        outputs: dict[str, Any] = {}
        for v in (0, 1):
            segment_features, ids, pooled = self.segments(self.backbone, views, v)
            if v == 0:
                outputs["features"] = pooled
            outputs[f"z{v + 1}"] = self.projector(segment_features.flatten(0, 1)).unflatten(
                0, ids.shape)
            outputs[f"ids{v + 1}"] = ids
        return outputs

    def _gather_segments(self, z: Tensor) -> Tensor:
        """``z`` (B, K, D) gathered with gradients as rows (B, K·D), so that the collective's
        backward receives a contiguous gradient: with the (B, K, D) tensor gathered directly,
        the einsum's permuted gradient made 2 gloo processes differ from one process."""
        return self.gather(z.flatten(1).contiguous()).unflatten(1, z.shape[1:])

    def loss_from_outputs(self, outputs: dict[str, Any]) -> Tensor:
        z1, z2, ids1, ids2 = outputs["z1"], outputs["z2"], outputs["ids1"], outputs["ids2"]
        return self.criterion(z1, z2, self._gather_segments(z1), self._gather_segments(z2),
                              ids1, ids2,
                              self.gather_no_grad(ids1), self.gather_no_grad(ids2),
                              self.rank_offset(z1.shape[0]))

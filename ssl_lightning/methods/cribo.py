"""CrIBo: Lebailly, Stegmüller, Bozorgtabar, Thiran & Tuytelaars, "CrIBo: Self-Supervised
Learning via Cross-Image Object-Level Bootstrapping", ICLR 2024.

DINO's student and EMA teacher on two global crops (no local crops in the released runs), plus
object-level self-distillation. Per image, the teacher's last-layer patch tokens of both views
are clustered together into K objects (:func:`~ssl_lightning.clustering.joint_views.
joint_view_clusters`), so object k is the same in both views; each view's tokens are mask-pooled
per object (:func:`~ssl_lightning.losses.detcon.mask_pool`), the student's with the teacher's
assignments; objects absent from one view are dropped. Three terms, summed:

- DINO's [CLS] loss (:class:`~ssl_lightning.losses.DINOLoss`);
- cross-view: each object's teacher output in one view is the target of the student's output of
  the same object in the other view;
- cross-image: each teacher object's nearest neighbour in a memory bank of earlier batches'
  teacher objects (:class:`~ssl_lightning.queues.object_queue.ObjectQueue`) is the target of the
  student's object in the other view, when the neighbour is cycle-consistent
  (:mod:`ssl_lightning.losses.cribo`), from ``cross_image_start_epoch`` on.

The object outputs come from a second last layer on the [CLS] head's MLP
(:class:`~ssl_lightning.heads.ObjectDINOHead`). The bank is filled with the gathered global
batch after the search, so N processes equal one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ssl_lightning.backbones.dense import dense_channels, dense_features
from ssl_lightning.backbones.multicrop import forward_by_resolution
from ssl_lightning.clustering.joint_views import draw_initial_tokens, joint_view_clusters
from ssl_lightning.distributed.collectives import sampler_order
from ssl_lightning.heads import ObjectDINOHead
from ssl_lightning.losses.cribo import CrIBoLoss, cycle_consistent_neighbours
from ssl_lightning.losses.detcon import mask_pool
from ssl_lightning.methods.dino import DINO
from ssl_lightning.methods.registry import (
    TWO_VIEWS,
    Paper,
    register_method,
    small_vit,
)
from ssl_lightning.optim import epoch_linspace
from ssl_lightning.queues.object_queue import ObjectQueue


@register_method(
    "cribo", title="CrIBo", configs=("cribo.yaml",),
    paper=Paper("CrIBo: Self-Supervised Learning via Cross-Image Object-Level Bootstrapping",
                2024, "2310.07855"),
    family="distillation", views=TWO_VIEWS, tests="tests/methods/test_cribo.py",
    backbone=lambda: small_vit(),
    position_keyed=True,  # the bank's slots follow the global batch's sampler order
    opt_outs={"model_help_accepted": (
        "CrIBo takes DINO's arguments through **kwargs, and refuses DINO's iBOT / DINOv3 terms "
        "(patch_distillation, gram_anchoring): its object terms replace the patch terms")},
    cli_args={"cribo.yaml": (
        "--model.init_args.backbone.init_args.depth", "1",
        "--model.init_args.backbone.init_args.arch", "tiny",
        "--model.init_args.head_out_dim", "64", "--model.init_args.object_out_dim", "64",
        "--model.init_args.head_hidden_dim", "32", "--model.init_args.head_bottleneck_dim", "16",
        "--model.init_args.num_objects", "4", "--model.init_args.queue_size", "256")},
    small=lambda backbone, **kw: CrIBo(backbone, **{
        "head_out_dim": 12, "head_hidden_dim": 16, "head_bottleneck_dim": 8,
        "object_out_dim": 10, "num_objects": 4, "queue_size": 16, "momentum_base": 0.9,
        "warmup_teacher_temperature_epochs": 0, "cross_image_start_epoch": 0, "image_size": 8,
        **kw}),
)
class CrIBo(DINO):
    """CrIBo on two views (module docstring).

    Args:
        backbone: Feature extractor with dense features (``forward_dense``; a ViT in the paper)
            whose token width equals its pooled feature size.
        head_out_dim: Outputs of the [CLS] head (65536).
        object_out_dim: Outputs of the object layer of the head (65536, ``out_dim_c``).
        norm_last_layer: Fix the norm of both last layers' rows (False in the released runs).
        num_objects: Clusters K per image (32, ``n_tokens``).
        clustering_iterations: Clustering rounds (5, ``n_iter``).
        clustering_sinkhorn_iterations: Sinkhorn rounds per clustering round (5).
        clustering_sharpness: λ of the transport plan (20, ``sinkhorn_lambda``).
        clustering_update_marginals: Cluster marginals follow the cluster sizes (``update_c``).
        queue_size: Images in the object bank (25,000); at least the global batch.
        cross_image_start_epoch: First epoch with the cross-image term (1: the authors skip the
            first epoch, while the bank fills).
        object_student_temperature: τ_s of the object terms (0.1).
        object_teacher_temperature: Final τ_t of the object terms (0.07) ...
        warmup_object_teacher_temperature: ... warmed up from this value (0.04) over
            ``warmup_teacher_temperature_epochs``, like the [CLS] τ_t.
        object_center_momentum: Momentum of the object centre (0.9).
        **kwargs: Other arguments of :class:`DINO` (head widths, [CLS] temperatures, teacher
            momentum, clipping, last-layer freezing, optimiser; ``num_local_crops``: local
            crops, which take part in the [CLS] loss only, as in the authors' code). The
            iBOT/DINOv3 terms stay off.
    """

    def __init__(
        self,
        backbone: nn.Module,
        head_out_dim: int = 65536,
        object_out_dim: int = 65536,
        norm_last_layer: bool = False,
        num_objects: int = 32,
        clustering_iterations: int = 5,
        clustering_sinkhorn_iterations: int = 5,
        clustering_sharpness: float = 20.0,
        clustering_update_marginals: bool = True,
        queue_size: int = 25000,
        cross_image_start_epoch: int = 1,
        object_student_temperature: float = 0.1,
        object_teacher_temperature: float = 0.07,
        warmup_object_teacher_temperature: float = 0.04,
        object_center_momentum: float = 0.9,
        **kwargs: Any,
    ) -> None:
        for name in ("patch_distillation", "gram_anchoring"):
            if kwargs.get(name):
                raise ValueError(f"CrIBo does not take {name}=True (its object terms replace "
                                 "the patch terms); leave it off.")
        if num_objects < 1 or queue_size < 1 or cross_image_start_epoch < 0:
            raise ValueError(f"CrIBo needs num_objects >= 1, queue_size >= 1 and "
                             f"cross_image_start_epoch >= 0, got {num_objects}, {queue_size}, "
                             f"{cross_image_start_epoch}.")
        self.object_out_dim = object_out_dim  # read by prototype_head during DINO's __init__
        super().__init__(backbone, head_out_dim=head_out_dim, norm_last_layer=norm_last_layer,
                         **kwargs)
        channels = dense_channels(self.backbone, kwargs.get("image_size", 32))
        if channels != self.feature_dim:
            raise ValueError(f"CrIBo pools the backbone's tokens into objects for the [CLS] "
                             f"head's MLP, so the token width must equal the feature size; "
                             f"{type(backbone).__name__} has {channels} and {self.feature_dim}.")
        self.num_objects = num_objects
        self.clustering_iterations = clustering_iterations
        self.clustering_sinkhorn_iterations = clustering_sinkhorn_iterations
        self.clustering_sharpness = clustering_sharpness
        self.clustering_update_marginals = clustering_update_marginals
        self.cross_image_start_epoch = cross_image_start_epoch
        self.object_teacher_temperatures = (warmup_object_teacher_temperature,
                                            object_teacher_temperature)
        self.object_criterion = CrIBoLoss(object_out_dim, object_student_temperature,
                                          object_center_momentum)
        self.object_queue = ObjectQueue(queue_size, num_objects, channels)

    def prototype_head(self, out_dim: int, hidden_dim: int, bottleneck_dim: int,
                       batch_norm: bool, norm_last_layer: bool) -> nn.Module:
        """The [CLS] head with CrIBo's second last layer for the objects."""
        return ObjectDINOHead(self.feature_dim, out_dim, hidden_dim, bottleneck_dim,
                              batch_norm=batch_norm, norm_last_layer=norm_last_layer,
                              object_out_dim=self.object_out_dim)

    def object_teacher_temperature(self, epoch: int) -> float:
        """τ_t of the object terms at ``epoch`` (the [CLS] warm-up schedule)."""
        return epoch_linspace(epoch, self.warmup_teacher_temperature_epochs,
                              *self.object_teacher_temperatures)

    # ------------------------------------------------------------------------------ forward
    def forward_views(self, views: Sequence[Tensor]) -> dict[str, Any]:
        """Both networks on the two views; the teacher's joint clusters; the objects' head
        outputs (per sample: (B, 2, ...))."""
        self.check_view_count(views)
        if views[0].shape != views[1].shape:
            raise ValueError(f"CrIBo's two views must have one shape, got "
                             f"{tuple(views[0].shape)} and {tuple(views[1].shape)}.")
        batch = views[0].shape[0]
        crops = torch.cat(list(views[:2]))
        with torch.no_grad():
            teacher_map, teacher_pooled = dense_features(self.teacher_backbone, crops)
            teacher_tokens = teacher_map.flatten(2).transpose(1, 2)  # (2B, N, C)
            tokens = teacher_tokens.shape[1]
            initial = draw_initial_tokens(batch, 2 * tokens, self.num_objects, crops.device)
            assignments = joint_view_clusters(
                teacher_tokens[:batch], teacher_tokens[batch:], initial,
                self.clustering_iterations, self.clustering_sinkhorn_iterations,
                self.clustering_sharpness, self.clustering_update_marginals)
            weights = torch.cat([assignments[:, :tokens], assignments[:, tokens:]])
            teacher_objects, ids = mask_pool(teacher_tokens, weights)  # (2B, K, C)
            valid = (ids[:batch] >= 0) & (ids[batch:] >= 0)
            teacher_cls = self.teacher_head(teacher_pooled)
            teacher_scores = self.teacher_head.forward_objects(teacher_objects)
        student_map, student_pooled = dense_features(self.backbone, crops)
        student_objects, _ = mask_pool(student_map.flatten(2).transpose(1, 2), weights)
        student_cls = self.head(student_pooled)
        if len(views) > 2:  # local crops: [CLS] loss only, as the authors' multi-crop
            student_cls = torch.cat([student_cls, self.head(
                forward_by_resolution(self.backbone, views[2:]))])

        def per_sample(x: Tensor) -> Tensor:  # (V·B, ...) view-major -> (B, V, ...)
            return x.unflatten(0, (-1, batch)).transpose(0, 1)

        return {"student_cls": per_sample(student_cls), "teacher_cls": per_sample(teacher_cls),
                "student_objects": per_sample(self.head.forward_objects(student_objects)),
                "teacher_objects": per_sample(teacher_scores),
                "teacher_pooled": per_sample(teacher_objects), "valid": valid,
                "features": student_pooled[:batch]}

    # --------------------------------------------------------------------------------- loss
    def loss_from_outputs(self, outputs: dict[str, Any]) -> Tensor:
        """DINO's [CLS] loss + the cross-view and cross-image object terms; the bank takes the
        global batch's teacher objects after the search."""
        epoch = self.current_epoch
        global_loss = self.criterion(outputs["student_cls"].unbind(1),
                                     outputs["teacher_cls"].unbind(1),
                                     self.teacher_temperature(epoch))
        valid, pooled = outputs["valid"], outputs["teacher_pooled"]
        batch, slots = valid.shape
        pooled_all = self.gather_no_grad(pooled)
        world = pooled_all.shape[0] // batch
        # the global batch in the samplers' order: the bank's slots and the cycle's indices
        # are those of one process holding the global batch
        pooled_all = sampler_order(pooled_all, world)
        valid_all = sampler_order(self.gather_no_grad(valid.long()), world).bool()
        own = (torch.arange(batch, device=valid.device) * world + self.rank_offset(1))
        neighbours, consistent = self.retrieve(pooled, valid, pooled_all, valid_all, own,
                                               epoch >= self.cross_image_start_epoch)
        self.object_queue.enqueue(pooled_all, valid_all)
        totals = self.gather_no_grad(torch.stack([
            valid.sum(dim=1), consistent[:, 0].sum(dim=1), consistent[:, 1].sum(dim=1)], dim=1))
        counts = tuple(float(c) / world for c in totals.sum(dim=0))
        cross_view, cross_image = self.object_criterion(
            outputs["student_objects"], outputs["teacher_objects"], valid, neighbours,
            consistent, self.object_teacher_temperature(epoch), counts)
        self.log_terms(global_loss=global_loss, cross_view_loss=cross_view,
                       cross_image_loss=cross_image,
                       objects_per_image=totals[:, 0].sum() / totals.shape[0],
                       consistent_ratio=totals[:, 1:].sum() / (2 * totals[:, 0].sum()).clamp_min(1))
        return global_loss + cross_view + cross_image

    @torch.no_grad()
    def retrieve(self, pooled: Tensor, valid: Tensor, pooled_all: Tensor, valid_all: Tensor,
                 images: Tensor, active: bool) -> tuple[Tensor, Tensor]:
        """Teacher head outputs of each object's bank neighbour, (B, 2, K, J), and which are
        cycle-consistent, (B, 2, K) (all False when ``active`` is False); ``images`` (B,) are
        this rank's images' rows in the global batch ``pooled_all`` / ``valid_all``."""
        batch, slots = valid.shape
        bank1, bank2, bank_valid = self.object_queue.bank()
        own = (images[:, None] * slots + torch.arange(slots, device=valid.device)).flatten()
        targets, masks = [], []
        for view, (same, other) in enumerate(((bank1, bank2), (bank2, bank1))):
            index, consistent = cycle_consistent_neighbours(
                pooled[:, view].flatten(0, 1), valid.flatten(), own,
                pooled_all[:, 1 - view].flatten(0, 1), valid_all.flatten(), same, other,
                bank_valid)
            targets.append(self.teacher_head.forward_objects(same[index].to(pooled.dtype)))
            masks.append(consistent & active)
        return (torch.stack(targets, dim=1).unflatten(0, (batch, slots)).transpose(1, 2),
                torch.stack(masks, dim=1).unflatten(0, (batch, slots)).transpose(1, 2))

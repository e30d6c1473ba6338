"""NeCo: Pariza, Salehi, Burghouts, Locatello & Asano, "Near, far: Patch-ordering enhances vision
foundation models' scene understanding", ICLR 2025.

A post-training method: it starts from a pre-trained backbone (a checkpoint or released weights,
``pretrained_path`` of the backbone) and an EMA teacher of it. Each view's feature map goes through
a patch projection MLP; the region both crops cover (the boxes of
:class:`~ssl_lightning.data.located_views.LocatedViews`) is RoI-aligned into a ``grid x grid``
map in each view (:mod:`ssl_lightning.losses.region_align`). With the teacher on one view and the
student on the other (both directions), every aligned patch is compared to reference patches —
the teacher's aligned patches of the global batch, shuffled by the step's shared seed — and the
student's soft neighbour order is pulled to the teacher's (:class:`~ssl_lightning.losses.NeCoLoss`,
relaxed bitonic sorting). Samples whose crops do not overlap are left out of the mean. A batch
without boxes aligns the whole views (for views of one image that share their crop).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ssl_lightning.backbones.dense import dense_channels, dense_features
from ssl_lightning.data.located_views import BOX_SIZE
from ssl_lightning.distributed import sampler_order
from ssl_lightning.heads import build_mlp
from ssl_lightning.losses import NeCoLoss
from ssl_lightning.losses.neco import Similarity
from ssl_lightning.losses.region_align import align_region, shared_region
from ssl_lightning.losses.soft_sort import SortingNetwork
from ssl_lightning.methods.momentum import MomentumMethod
from ssl_lightning.methods.registry import TWO_VIEWS, Paper, register_method
from ssl_lightning.training.ema import momentum_teacher

#: :meth:`~ssl_lightning.training.step_rng.SeededSteps.step_generator` stream of the reference
#: patches' shuffle.
REFERENCE_STREAM = 1


@register_method(
    "neco", title="NeCo", configs=("neco.yaml",),
    paper=Paper("Near, far: Patch-ordering enhances vision foundation models' scene "
                "understanding", 2025, "2408.11054"),
    family="distillation", views=TWO_VIEWS, tests="tests/methods/test_neco.py",
    small=lambda backbone, **kw: NeCo(backbone, projection_hidden_dim=16, projection_dim=8,
                                      grid=2, student_steepness=10.0, teacher_steepness=10.0,
                                      momentum_base=0.9, **kw),
    cli_args={"neco.yaml": (  # the shape of the released-backbone file the config test writes
        "--model.init_args.backbone.init_args.embed_dim", "32",
        "--model.init_args.backbone.init_args.depth", "1",
        "--model.init_args.backbone.init_args.num_heads", "2",
        "--model.init_args.projection_hidden_dim", "16", "--model.init_args.projection_dim", "8",
        "--model.init_args.grid", "2", "--model.init_args.image_size", "28",
        "--data.init_args.train_transform.init_args.crop_size", "28")},
    position_keyed=True,
)
class NeCo(MomentumMethod):
    """NeCo patch neighbour-consistency post-training on two views.

    Args:
        backbone: Pre-trained feature extractor with a feature map (``forward_dense``).
        projection_hidden_dim: Hidden width of the patch projection MLP (2048, the authors'
            ``projection_hidden_dim``).
        projection_dim: Patch embedding size (256, ``projection_feat_dim``).
        projection_layers: Linear layers of the MLP (3, ``n_layers_projection_head``).
        grid: Side of the RoI-aligned grid of the shared region (7, ``roi_align_kernel_size``);
            grid² patches per view and as many reference patches per sample.
        student_steepness: β of the student's relaxed sort (100).
        teacher_steepness: β of the teacher's (100).
        network: Sorting network, ``"bitonic"`` (the authors' ``sort_net``) or ``"odd_even"``.
        similarity: ``"cosine"`` (the authors' ``sim_dist``) or ``"euclidean"``.
        **kwargs: ``momentum_*`` arguments of :class:`MomentumMethod` and optimiser arguments of
            :class:`SSLMethod`.
    """

    views_used = None  # the two views and, when present, their two crop boxes

    def __init__(
        self,
        backbone: nn.Module,
        projection_hidden_dim: int = 2048,
        projection_dim: int = 256,
        projection_layers: int = 3,
        grid: int = 7,
        student_steepness: float = 100.0,
        teacher_steepness: float = 100.0,
        network: SortingNetwork = "bitonic",
        similarity: Similarity = "cosine",
        **kwargs: Any,
    ) -> None:
        if grid < 1:
            raise ValueError(f"grid must be >= 1, got {grid}.")
        super().__init__(backbone, **kwargs)
        self.grid = grid
        self.student_steepness = student_steepness
        self.teacher_steepness = teacher_steepness
        self.network: SortingNetwork = network
        self.similarity: Similarity = similarity
        channels = dense_channels(self.backbone, kwargs.get("image_size", 32))
        self.projector = build_mlp(channels, projection_hidden_dim, projection_dim,
                                   projection_layers, batch_norm=False)
        self.teacher_backbone = momentum_teacher(self.backbone)
        self.teacher_projector = momentum_teacher(self.projector)

    def build_criterion(self) -> NeCoLoss:
        return NeCoLoss(self.student_steepness, self.teacher_steepness, self.network,
                        self.similarity)

    def ema_pairs(self) -> list[tuple[nn.Module, nn.Module]]:
        return [(self.backbone, self.teacher_backbone), (self.projector, self.teacher_projector)]

    @staticmethod
    def _boxes(views: Sequence[Tensor]) -> tuple[Tensor, Tensor] | None:
        if len(views) < 4:
            return None
        if any(v.dim() != 2 or v.shape[1] != BOX_SIZE for v in views[2:4]):
            raise ValueError(
                "NeCo takes two views, optionally followed by their crop boxes "
                f"(train_transform: LocatedViews); got a third view of shape "
                f"{tuple(views[2].shape)}. Use LocatedViews or SimCLRViews with two views.")
        return views[2], views[3]

    def _projected(self, backbone: nn.Module, projector: nn.Module, x: Tensor
                   ) -> tuple[Tensor, Tensor]:
        feature_map, pooled = dense_features(backbone, x)
        return projector(feature_map.permute(0, 2, 3, 1)).permute(0, 3, 1, 2), pooled

    def forward_views(self, views: Sequence[Tensor]) -> dict[str, Any]:
        self.require_views(views)
        boxes = self._boxes(views)
        region, overlaps = shared_region(*boxes) if boxes is not None else (None, None)
        outputs: dict[str, Any] = {}
        for v in (0, 1):
            student_map, pooled = self._projected(self.backbone, self.projector, views[v])
            if v == 0:
                outputs["features"] = pooled
            with torch.no_grad():
                teacher_map = self._projected(self.teacher_backbone, self.teacher_projector,
                                              views[v])[0]
            view_boxes = boxes[v] if boxes is not None else None
            outputs[f"student{v}"] = align_region(student_map, view_boxes, region, self.grid)
            outputs[f"teacher{v}"] = align_region(teacher_map, view_boxes, region, self.grid)
        outputs["overlaps"] = overlaps if overlaps is not None else torch.ones(
            len(views[0]), dtype=torch.bool, device=views[0].device)
        return outputs

    def _references(self, teacher: Tensor) -> Tensor:
        """The teacher's aligned patches of the global batch (G, N, C), shuffled over the batch
        by the step's shared seed and dealt N to each sample."""
        flat = teacher.flatten(0, 1)
        order = torch.randperm(len(flat), generator=self.step_generator(REFERENCE_STREAM))
        return flat[order.to(flat.device)].view_as(teacher)

    def _global(self, outputs: dict[str, Any], name: str, grad: bool = False) -> Tensor:
        """``outputs[name]`` of the global batch in its sampler order (the references depend on
        a patch's place in the batch, so N processes must see the 1-process order)."""
        local = outputs[name]
        gathered = self.gather(local) if grad else self.gather_no_grad(local)
        return sampler_order(gathered, len(gathered) // len(local))

    def loss_from_outputs(self, outputs: dict[str, Any]) -> Tensor:
        overlaps = self._global(outputs, "overlaps")
        terms = []
        for teacher_view, student_view in ((0, 1), (1, 0)):
            teacher = self._global(outputs, f"teacher{teacher_view}")
            student = self._global(outputs, f"student{student_view}", grad=True)
            terms.append(self.criterion(student, teacher, self._references(teacher), overlaps))
        return (terms[0] + terms[1]) / 2

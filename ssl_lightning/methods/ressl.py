"""ReSSL: Zheng et al., "ReSSL: Relational Self-Supervised Learning with Weak Augmentation",
NeurIPS 2021.

A student (backbone + projection MLP) and its EMA teacher. The target is relational: the
teacher's softmax similarities (τ_t = 0.04) of a *weakly* augmented view to a queue of earlier
teacher embeddings, matched by the student's (τ_s = 0.1) of a strongly augmented view with a
cross-entropy (:class:`~ssl_lightning.losses.ReSSLLoss`). The teacher keys of the gathered batch
are enqueued after the loss, so every rank holds the same queue; the queue resumes with the
checkpoint.

Views: ``[strong, weak]`` — the data's transform appends the weak view (``weak_views: 1`` of
:class:`~ssl_lightning.data.SimCLRViews`, :class:`~ssl_lightning.data.MultiCropViews` or
:class:`~ssl_lightning.data.DeviceViews`); the method's ``weak_views`` says it expects one and is
checked against the transform before the first step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ssl_lightning.heads import ProjectionHead
from ssl_lightning.losses import ReSSLLoss
from ssl_lightning.methods.momentum import MomentumMethod
from ssl_lightning.methods.registry import SMALL_CONVNET_ARGS, TWO_VIEWS, Paper, register_method
from ssl_lightning.queues import FeatureQueue
from ssl_lightning.training.ema import Schedule, momentum_teacher


@register_method(
    "ressl", title="ReSSL", configs=("ressl.yaml",),
    paper=Paper("ReSSL: Relational Self-Supervised Learning with Weak Augmentation",
                2021, "2107.09282"),
    family="distillation", views=TWO_VIEWS, tests="tests/methods/test_ressl.py",
    cli_args={
        "ressl.yaml": (*SMALL_CONVNET_ARGS,
                       "--model.init_args.projection_hidden_dim", "64",
                       "--model.init_args.projection_dim", "64",
                       "--model.init_args.queue_size", "256"),
    },
    small=lambda backbone, **kw: ReSSL(backbone, projection_hidden_dim=16, projection_dim=8,
                                       queue_size=16, momentum_base=0.9, **kw),
)
class ReSSL(MomentumMethod):
    """ReSSL.

    Args:
        backbone: Feature extractor (see :class:`SSLMethod`).
        projection_hidden_dim: Hidden width of the 2-layer projection MLP (solo-learn: 4096).
        projection_dim: Embedding size (256).
        head_batch_norm: BatchNorm in the projection MLP (the paper's head has none).
        queue_size: Teacher embeddings in the queue (solo-learn: 65536); a multiple of the global
            batch.
        student_temperature: τ_s (0.1 in the paper).
        teacher_temperature: τ_t (0.04 in the paper).
        weak_views: 1: views are ``[strong, weak]`` and the teacher sees the weak one (the
            paper); 0: the teacher sees a second strong view. Must equal the data transform's
            ``weak_views``.
        momentum_base: Teacher momentum at the first step (0.99 for CIFAR in the paper).
        momentum_schedule: ``"cosine"`` towards ``momentum_end`` or ``"constant"``.
        projector: A projection head to use instead of the MLP above (features ->
            ``projection_dim``).
        **kwargs: Other arguments of :class:`MomentumMethod` and :class:`SSLMethod`.
    """

    batch_coupled_loss = False  # each sample against the queue

    def __init__(
        self,
        backbone: nn.Module,
        projection_hidden_dim: int = 4096,
        projection_dim: int = 256,
        head_batch_norm: bool = False,
        queue_size: int = 65536,
        student_temperature: float = 0.1,
        teacher_temperature: float = 0.04,
        weak_views: int = 1,
        momentum_base: float = 0.99,
        momentum_schedule: Schedule = "cosine",
        projector: nn.Module | None = None,
        **kwargs: Any,
    ) -> None:
        if queue_size < 1:
            raise ValueError(f"queue_size must be >= 1, got {queue_size}.")
        if weak_views not in (0, 1):
            raise ValueError(f"ReSSL weak_views must be 0 or 1 (the teacher's view is the "
                             f"second view), got {weak_views}.")
        super().__init__(backbone, momentum_base=momentum_base,
                         momentum_schedule=momentum_schedule, **kwargs)
        self.projector = self.build_head("projector", projector, lambda: ProjectionHead(
            self.feature_dim, projection_hidden_dim, projection_dim, batch_norm=head_batch_norm,
        ), self.feature_dim, projection_dim, "projection_dim")
        self.teacher_backbone = momentum_teacher(self.backbone)
        self.teacher_projector = momentum_teacher(self.projector)
        self.queue = FeatureQueue(queue_size, projection_dim)
        self.student_temperature, self.teacher_temperature = (student_temperature,
                                                              teacher_temperature)
        self.weak_views = weak_views

    def build_criterion(self) -> nn.Module:
        return ReSSLLoss(self.student_temperature, self.teacher_temperature)

    def ema_pairs(self) -> list[tuple[nn.Module, nn.Module]]:
        return [(self.backbone, self.teacher_backbone), (self.projector, self.teacher_projector)]

    def on_fit_start(self) -> None:
        """Fail before the first step when the data's transform makes a different number of
        weak views than ``weak_views``."""
        super().on_fit_start()
        data = getattr(self.trainer, "datamodule", None)
        transform = getattr(data, "device_transform", None) or getattr(
            data, "train_transform", None)
        actual, expected = getattr(transform, "weak_views", None), self.weak_views
        if actual is not None and actual != expected:
            raise ValueError(
                f"ReSSL expects weak_views={expected} (its teacher sees the second view"
                f"{', a weak one' if expected else ''}), but the data's "
                f"{type(transform).__name__} makes {actual} weak view(s). Set the transform's "
                f"weak_views: {expected} (e.g. SimCLRViews num_views: 1, weak_views: 1) or the "
                f"model's weak_views: {actual}."
            )

    def forward_views(self, views: Sequence[Tensor]) -> dict[str, Any]:
        self.require_views(views)
        features = self.backbone(views[0])
        with torch.no_grad():
            key = self.teacher_projector(self.teacher_backbone(views[1]))
        return {"student": self.projector(features), "teacher": F.normalize(key, dim=1),
                "features": features}

    def loss_from_outputs(self, outputs: dict[str, Any]) -> Tensor:
        loss = self.criterion(outputs["student"], outputs["teacher"], self.queue.negatives())
        self.queue.enqueue(self.gather_no_grad(outputs["teacher"]))
        return loss

"""SMoG: Pang et al., "Unsupervised Visual Representation Learning by Synchronous Momentum
Grouping", ECCV 2022.

BYOL's networks (student backbone → projector → predictor, EMA teacher backbone → projector)
with group features in place of the teacher's targets: each view's teacher projection is
assigned to its nearest group, the group features move by momentum towards the student
projections assigned to them (:func:`~ssl_lightning.clustering.momentum_group_update`,
β = 0.99), and the other view's prediction is trained to pick that group among all of them
(cross-entropy of cosine scores / τ, :class:`DeepClusterLoss` with one "head" per direction).
Every ``reset_every`` steps the groups are reset by spherical k-means over a bank of recent
student projections (a :class:`~ssl_lightning.queues.FeatureQueue`) and the teacher to the
student (the paper's Table 7b).

Every update uses the gathered global batch, so the groups, the bank and the k-means result are
the same on every rank (k-means sums its statistics over ranks), and the bank is filled in the
global batch's sampler order (:func:`~ssl_lightning.distributed.sampler_order`), so its slots,
the k-means start and the groups are those of one process fed that order; all are buffers, so
resuming is exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ssl_lightning._lightning import attached_trainer
from ssl_lightning.clustering import (
    initial_centroids,
    momentum_group_update,
    spherical_kmeans,
)
from ssl_lightning.data.seeding import sample_seed
from ssl_lightning.distributed import rank, sampler_order, world_size
from ssl_lightning.losses import DeepClusterLoss
from ssl_lightning.methods.byol import BYOL
from ssl_lightning.methods.registry import SMALL_CONVNET_ARGS, TWO_VIEWS, Paper, register_method
from ssl_lightning.queues import FeatureQueue


@register_method(
    "smog", title="SMoG", configs=("smog.yaml",),
    paper=Paper("Unsupervised Visual Representation Learning by Synchronous Momentum Grouping",
                2022, "2207.06167"),
    family="clustering", views=TWO_VIEWS, tests="tests/methods/test_smog.py",
    cli_args={
        "smog.yaml": (*SMALL_CONVNET_ARGS,
                      "--model.init_args.projection_hidden_dim", "64",
                      "--model.init_args.num_groups", "4",
                      "--model.init_args.queue_size", "16",
                      "--model.init_args.reset_every", "2"),
    },
    matrix_args={
        "smog.yaml": ("--model.init_args.num_groups", "4",
                      "--model.init_args.queue_size", "16",
                      "--model.init_args.reset_every", "2"),
    },
    small=lambda backbone, **kw: SMoG(backbone, projection_hidden_dim=16, projection_dim=8,
                                      head_batch_norm=False, num_groups=4, reset_every=2,
                                      queue_size=16, kmeans_iterations=3, momentum_base=0.9, **kw),
    position_keyed=True,
)
class SMoG(BYOL):
    """SMoG (symmetrised: both views predict the other view's group every step).

    Args:
        backbone: Feature extractor (see :class:`SSLMethod`).
        num_groups: Group features G (lightly's CIFAR-10 benchmark: 300; the paper 3000).
        group_momentum: β of the group update (0.99).
        temperature: τ of the group scores (0.1).
        reset_every: Steps between k-means resets of the groups (300).
        queue_size: Student projections kept for the reset (global; a multiple of the global
            batch; lightly: 300 x batch size).
        kmeans_iterations: k-means rounds of a reset.
        **kwargs: Head, momentum and optimiser arguments of :class:`BYOL`.
    """

    batch_coupled_loss: ClassVar[bool] = True  # the groups move with the batch

    groups: Tensor

    def __init__(self, backbone: nn.Module, num_groups: int = 300, group_momentum: float = 0.99,
                 temperature: float = 0.1, reset_every: int = 300, queue_size: int = 76800,
                 kmeans_iterations: int = 10, **kwargs: Any) -> None:
        for name, value in (("num_groups", num_groups), ("reset_every", reset_every),
                            ("queue_size", queue_size), ("kmeans_iterations", kmeans_iterations)):
            if value < 1:
                raise ValueError(f"SMoG {name} must be >= 1, got {value}.")
        if not 0 <= group_momentum < 1:
            raise ValueError(f"SMoG group_momentum must be in [0, 1), got {group_momentum}.")
        if num_groups > queue_size:
            raise ValueError(f"SMoG num_groups={num_groups} exceeds queue_size={queue_size}: "
                             "k-means needs at least one bank row per group.")
        super().__init__(backbone, **kwargs)
        self.group_momentum, self.temperature = group_momentum, temperature
        self.reset_every, self.kmeans_iterations = reset_every, kmeans_iterations
        dim = self.projection_dim
        self.bank = FeatureQueue(queue_size, dim)
        generator = torch.Generator().manual_seed(1)
        self.register_buffer("groups", F.normalize(torch.randn(num_groups, dim,
                                                               generator=generator), dim=1))

    def build_criterion(self) -> nn.Module:
        return DeepClusterLoss(self.temperature)

    def forward_views(self, views: Sequence[Tensor]) -> dict[str, Any]:
        """Student projections ``s`` and predictions ``p``, teacher projections ``z`` of views
        0 and 1."""
        self.require_views(views)
        features = self.backbone(views[0])
        s1, s2 = self.projector(features), self.projector(self.backbone(views[1]))
        with torch.no_grad():
            z1 = self.teacher_projector(self.teacher_backbone(views[0]))
            z2 = self.teacher_projector(self.teacher_backbone(views[1]))
        return {"p1": self.predictor(s1), "p2": self.predictor(s2), "z1": z1, "z2": z2,
                "s1": s1.detach(), "s2": s2.detach(), "features": features}

    @torch.no_grad()
    def reset_groups(self) -> None:
        """Groups ← spherical k-means of the bank (rows split over ranks, sums all-reduced);
        teacher ← student."""
        bank = self.bank.queue
        start = initial_centroids(bank, self.groups.shape[0],
                                  sample_seed(1, self.trainer.global_step, 0))
        self.groups.copy_(spherical_kmeans(bank[rank()::world_size()], start,
                                           self.kmeans_iterations))
        for student, teacher in self.ema_pairs():
            teacher.load_state_dict(student.state_dict())

    def loss_from_outputs(self, outputs: dict[str, Any]) -> Tensor:
        step = self.trainer.global_step if attached_trainer(self) is not None else 0
        if step > 0 and step % self.reset_every == 0:
            self.reset_groups()
        targets = torch.stack([self.groups_of(outputs["z2"]), self.groups_of(outputs["z1"])])
        s1, s2 = (F.normalize(self.gather_no_grad(outputs[k]), dim=1) for k in ("s1", "s2"))
        self.groups.copy_(momentum_group_update(self.groups, torch.cat([s1, s2]),
                                                self.group_momentum))
        groups = F.normalize(self.groups, dim=1)
        scores = [F.normalize(outputs[k], dim=1).unsqueeze(1) @ groups.T for k in ("p1", "p2")]
        self.bank.enqueue(sampler_order(s1, len(s1) // len(outputs["s1"])))  # 1 process's slots
        return self.criterion(scores, targets)

    def groups_of(self, z: Tensor) -> Tensor:
        """Nearest group of each (teacher) projection, (B,)."""
        return (F.normalize(z, dim=1) @ F.normalize(self.groups, dim=1).T).argmax(dim=1)

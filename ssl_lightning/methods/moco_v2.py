"""MoCo v2: He et al., "Momentum Contrast for Unsupervised Visual Representation Learning",
CVPR 2020, with the improvements of Chen, Fan, Girshick & He, "Improved Baselines with Momentum
Contrastive Learning", arXiv:2003.04297 (MLP head, blur augmentation, cosine lr, T = 0.2).

A query encoder (backbone + MLP head), a key encoder that is its EMA, and InfoNCE of each query
against its key and a queue of keys from earlier batches. Keys are gathered from all ranks before
they are enqueued, so every rank holds the same queue.

BatchNorm across ranks: with ``shuffle_bn`` (the paper's §3.3 "shuffling BN"), the key batch is
gathered, permuted with a permutation every rank draws identically from a checkpointed counter,
encoded in per-rank chunks and un-shuffled, so the key of a sample is never normalised together
with its query's batch. It is a no-op on one device. The alternative is SyncBN
(``--trainer.sync_batchnorm true`` with ``shuffle_bn: false``), at the cost of one all-reduce per
BatchNorm layer. We chose shuffle-BN as the default because it is the recipe of the paper.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ssl_lightning.compat.renamed import renamed_argument
from ssl_lightning.heads import ProjectionHead
from ssl_lightning.losses import InfoNCELoss
from ssl_lightning.methods.momentum import MomentumMethod
from ssl_lightning.methods.registry import TWO_VIEWS, Paper, register_method
from ssl_lightning.queues import FeatureQueue
from ssl_lightning.training.ema import Schedule, momentum_teacher


@register_method(
    "moco_v2", title="MoCo v2", configs=("moco_v2.yaml",),
    paper=Paper("Improved Baselines with Momentum Contrastive Learning", 2020, "2003.04297"),
    family="contrastive", views=TWO_VIEWS, tests="tests/methods/test_moco_v2.py",
    cli_args={
        "moco_v2.yaml": ("--model.init_args.projection_hidden_dim", "64"),
    },
    small=lambda backbone, **kw: MoCoV2(backbone, projection_hidden_dim=16, projection_dim=8,
                                        queue_size=16, symmetric=True, momentum_base=0.9, **kw),
)
class MoCoV2(MomentumMethod):
    """MoCo v2 (and the symmetric "MoCo v2+" loss).

    Args:
        backbone: Feature extractor (see :class:`SSLMethod`).
        projection_hidden_dim: Hidden width of the MLP head (2048 in MoCo v2).
        projection_dim: Embedding size (128).
        head_batch_norm: BatchNorm in the head (MoCo v2 has none: fc-ReLU-fc).
        queue_size: Number of negatives (65536 ImageNet, 4096 CIFAR); a multiple of the global
            batch (per-device batch × world size).
        temperature: InfoNCE temperature (0.2 in MoCo v2).
        symmetric: Use both views as queries, ``(L(q1, k2) + L(q2, k1)) / 2``; the queue then
            still receives the keys of the second view only, one global batch per step.
        shuffle_bn: Shuffle the key batch across ranks (see the module docstring).
        momentum_base: Key-encoder momentum (0.999 in MoCo; 0.99 is better for short CIFAR runs).
        momentum_schedule: ``"constant"`` (MoCo) or ``"cosine"`` towards ``momentum_end``.
        projector: A projection head to use instead of the MLP above (any module mapping the
            backbone features to ``projection_dim``); the ``projection_*`` widths then only
            set ``projection_dim``.
        projection_batch_norm: Deprecated name of ``head_batch_norm``.
        **kwargs: Other arguments of :class:`MomentumMethod` and :class:`SSLMethod`.
    """

    batch_coupled_loss = False  # per-sample InfoNCE against the queue

    shuffle_step: Tensor

    renamed_arguments = {"projection_batch_norm": "head_batch_norm"}

    def __init__(
        self,
        backbone: nn.Module,
        projection_hidden_dim: int = 2048,
        projection_dim: int = 128,
        head_batch_norm: bool = False,
        queue_size: int = 65536,
        temperature: float = 0.2,
        symmetric: bool = False,
        shuffle_bn: bool = True,
        momentum_base: float = 0.999,
        momentum_schedule: Schedule = "constant",
        projector: nn.Module | None = None,
        *,
        projection_batch_norm: bool | None = None,
        **kwargs: Any,
    ) -> None:
        head_batch_norm = renamed_argument(self, "projection_batch_norm", projection_batch_norm,
                                           head_batch_norm)
        if queue_size < 1:
            raise ValueError(f"queue_size (the negatives) must be >= 1, got {queue_size}.")
        super().__init__(backbone, momentum_base=momentum_base,
                         momentum_schedule=momentum_schedule, **kwargs)
        self.projector = self.build_head("projector", projector, lambda: ProjectionHead(
            self.feature_dim, projection_hidden_dim, projection_dim,
            batch_norm=head_batch_norm,
        ), self.feature_dim, projection_dim, "projection_dim")
        self.teacher_backbone = momentum_teacher(self.backbone)
        self.teacher_projector = momentum_teacher(self.projector)
        self.queue = FeatureQueue(queue_size, projection_dim)
        self.temperature, self.projection_dim = temperature, projection_dim
        self.symmetric = symmetric
        self.shuffle_bn = shuffle_bn
        self.register_buffer("shuffle_step", torch.zeros((), dtype=torch.long))

    def build_criterion(self) -> nn.Module:
        return InfoNCELoss(self.temperature)

    def ema_pairs(self) -> list[tuple[nn.Module, nn.Module]]:
        return [(self.backbone, self.teacher_backbone), (self.projector, self.teacher_projector)]

    @torch.no_grad()
    def encode_keys(self, x: Tensor) -> Tensor:
        """Normalised keys of the local batch (B, D). With shuffle-BN under DDP this gathers
        the images and the keys (the one collective inside :meth:`forward_views`)."""
        return self.shuffled_teacher(lambda images: (F.normalize(
            self.teacher_projector(self.teacher_backbone(images)), dim=1),), x)[0]

    @torch.no_grad()
    def shuffled_teacher(self, encode: Callable[[Tensor], tuple[Tensor, ...]], x: Tensor
                         ) -> tuple[Tensor, ...]:
        """``encode(x)`` (per-sample teacher outputs, batch in dim 0), with shuffle-BN under
        DDP: the gathered images are encoded in the chunk a shared permutation gives this rank
        and the outputs un-shuffled, so each sample's outputs come back in its own row."""
        batch, offset = x.shape[0], self.rank_offset(x.shape[0])
        x_all = self.gather_no_grad(x) if self.shuffle_bn else x
        if x_all.shape[0] == batch:  # one process (or no shuffling): plain forward
            return encode(x)
        generator = torch.Generator().manual_seed(int(self.shuffle_step))
        perm = torch.randperm(x_all.shape[0], generator=generator).to(x.device)
        self.shuffle_step += 1
        results = []
        for shuffled in (self.gather_no_grad(out) for out in encode(
                x_all[perm[offset : offset + batch]])):
            unshuffled = torch.empty_like(shuffled)
            unshuffled[perm] = shuffled  # row j of `shuffled` is the output of sample perm[j]
            results.append(unshuffled[offset : offset + batch])
        return tuple(results)

    def forward_views(self, views: Sequence[Tensor]) -> dict[str, Any]:
        self.require_views(views)
        features = self.backbone(views[0])
        outputs = {"key2": self.encode_keys(views[1]), "query1": self.projector(features),
                   "features": features}
        if self.symmetric:
            outputs["key1"] = self.encode_keys(views[0])
            outputs["query2"] = self.projector(self.backbone(views[1]))
        return outputs

    def loss_from_outputs(self, outputs: dict[str, Any]) -> Tensor:
        negatives = self.queue.negatives()
        loss = self.criterion(outputs["query1"], outputs["key2"], negatives)
        if self.symmetric:
            loss = (loss + self.criterion(outputs["query2"], outputs["key1"], negatives)) / 2
        self.queue.enqueue(self.gather_no_grad(outputs["key2"]))
        return loss

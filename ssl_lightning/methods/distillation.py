"""Distillation from a frozen teacher into any student (lightly-train's default pre-training).

A frozen teacher (our checkpoint, a torchvision / timm model with a local weights file, a ViT)
and a trainable student see the same augmented view, mixed with another image of the global
batch (mixup, Zhang et al., ICLR 2018). The loss is one of the variants of
:class:`~ssl_lightning.losses.distillation.DistillationLoss`: the global term (the student's
pooled feature through a linear head against a queue of gathered teacher embeddings), plus the
local term (patch-to-patch similarities of the teacher's map and of the student's map, resized
bilinearly to the teacher's grid and projected linearly), or the MSE on the teacher's
last-two-block patch features (lightly-train's DistillationV2).

The teacher stays in eval mode without gradients; it is left out of checkpoints and rebuilt
from its spec (or from ``teacher_checkpoint``) when one is loaded, its weights checked against
the fingerprint the checkpoint records. Under DDP the queue receives the gathered teacher
embeddings and mixup pairs samples of the global batch, so N processes train like one.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import MutableMapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ssl_lightning.backbones import backbone_spec, feature_dim
from ssl_lightning.backbones.checkpoint import DEFAULT_PREFIX
from ssl_lightning.backbones.dense import dense_channels, dense_features
from ssl_lightning.backbones.teacher import frozen_teacher, weight_fingerprint
from ssl_lightning.backbones.tokens import layout
from ssl_lightning.distributed.sharding import full_state_dict
from ssl_lightning.heads.mlp import build_mlp
from ssl_lightning.losses.distillation import VARIANTS, DistillationLoss, Variant
from ssl_lightning.methods.base import Batch, SSLMethod
from ssl_lightning.methods.registry import (
    SMALL_CONVNET_ARGS,
    SMALL_TIMM_TEACHER_ARGS,
    Paper,
    register_method,
    small_vit,
)
from ssl_lightning.optim import LRScaling, OptimizerName
from ssl_lightning.queues import FeatureQueue
from ssl_lightning.training.mixup import global_batch_mixup
from ssl_lightning.training.step_rng import step_seed

#: Checkpoint entry with the teacher's weight fingerprint (:func:`weight_fingerprint`).
FINGERPRINT_KEY = "teacher_fingerprint"


def _small_teacher() -> nn.Module:
    """The small instance's teacher: a small ViT with the same weights every time (as a
    pretrained teacher has), whatever the global RNG's state."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return small_vit(embed_dim=24)


@register_method(
    "distillation", title="Distillation", configs=("distillation.yaml", "distillation_timm.yaml"),
    paper=Paper("Distilling the Knowledge in a Neural Network", 2015, "1503.02531"),
    family="distillation", views=(8,), tests="tests/methods/test_distillation.py",
    docs="docs/distillation.md",
    opt_outs={"load_from_checkpoint": (
        "the small instance's teacher is a randomly initialised ViT, which checkpoints do not "
        "store (only its spec and weight fingerprint) and no spec can rebuild, so the load is "
        "refused; with a teacher from pretrained weights or teacher_checkpoint (every real "
        "run), load_from_checkpoint(path) rebuilds it: tests/methods/test_distillation.py")},
    backbone=lambda: small_vit(),
    cli_args={
        "distillation_timm.yaml": SMALL_CONVNET_ARGS,
    },
    matrix_args={
        "distillation_timm.yaml": SMALL_TIMM_TEACHER_ARGS,
    },
    small=lambda backbone, **kw: Distillation(backbone, teacher=_small_teacher(),
                                              queue_size=16, head_hidden_dim=16, image_size=8,
                                              **kw),
)
class Distillation(SSLMethod):
    """Distillation of a frozen teacher into the student ``backbone``.

    Give the teacher in exactly one way: ``teacher`` (a backbone module, e.g. a config's
    ``{class_path: TimmBackbone, init_args: {name: ..., pretrained_path: ...}}``),
    ``teacher_checkpoint`` (a ``.ckpt`` of ours) or ``teacher_spec``.

    Args:
        backbone: The student (see :class:`SSLMethod`); the local and patch variants need its
            dense features (:mod:`ssl_lightning.backbones.dense`).
        teacher: The teacher module, with its weights (``pretrained_path``).
        teacher_checkpoint: A checkpoint of ours; the teacher is its backbone, rebuilt from its
            ``backbone_spec`` and loaded from ``teacher_checkpoint_prefix``.
        teacher_checkpoint_prefix: ``"backbone."`` (the student of that run) or, for an EMA
            method, ``"teacher_backbone."``.
        teacher_spec: ``{"class_path": ..., "init_args": {...}}`` of the teacher (recorded in
            the hyperparameters when ``teacher`` is given, so ``load_from_checkpoint`` rebuilds
            it); its ``pretrained_path`` is loaded.
        variant: ``"global_local"`` (default), ``"global"`` or ``"patch_mse"``.
        queue_size: Teacher embeddings in the queue; a multiple of the global batch.
        temperature: τ of the global term (0.07, lightly-train).
        local_temperature: τ of the local term.
        local_weight: Weight of the local term.
        teacher_blocks: ``patch_mse``: the teacher's last blocks whose patch features are
            concatenated (2, lightly-train's DistillationV2; > 1 needs a :class:`ViT` teacher).
        head_hidden_dim: Hidden width of the ``patch_mse`` MLP head.
        teacher_image_size: Resize the images (bilinear) to this side for the teacher only,
            e.g. 224 for a DINOv2 ViT-S/14; None: the student's size.
        mixup: Mix every image with another of the global batch, one weight per step.
        optimizer, lr, lr_scaling, weight_decay: AdamW at 5e-4 × sqrt(global batch / 1536)
            (lightly-train), written for the ``sqrt`` rule ``lr × sqrt(global batch)``.
        **kwargs: Other arguments of :class:`SSLMethod`.
    """

    views_used = 1
    batch_coupled_loss = False  # per-sample terms; the queue is filled once per optimiser step
    unsaved_state_prefixes = ("teacher.",)

    def __init__(
        self,
        backbone: nn.Module,
        teacher: nn.Module | None = None,
        teacher_checkpoint: str | None = None,
        teacher_checkpoint_prefix: str = DEFAULT_PREFIX,
        teacher_spec: dict[str, Any] | None = None,
        variant: Variant = "global_local",
        queue_size: int = 8192,
        temperature: float = 0.07,
        local_temperature: float = 0.07,
        local_weight: float = 1.0,
        teacher_blocks: int = 2,
        head_hidden_dim: int = 2048,
        teacher_image_size: int | None = None,
        mixup: bool = True,
        optimizer: OptimizerName = "adamw",
        lr: float = 5e-4 / math.sqrt(1536),
        lr_scaling: LRScaling = "sqrt",
        weight_decay: float = 1e-6,
        **kwargs: Any,
    ) -> None:
        if variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}.")
        if queue_size < 1:
            raise ValueError(f"queue_size must be >= 1, got {queue_size}.")
        super().__init__(backbone, optimizer=optimizer, lr=lr, lr_scaling=lr_scaling,
                         weight_decay=weight_decay, **kwargs)
        self.variant, self.teacher_image_size, self.mixup = variant, teacher_image_size, mixup
        self.temperature, self.local_temperature = temperature, local_temperature
        self.local_weight = local_weight
        self.teacher = frozen_teacher(teacher, teacher_checkpoint, teacher_checkpoint_prefix,
                                      teacher_spec)
        if teacher is not None:  # load_from_checkpoint rebuilds it from the spec
            self.hparams["teacher_spec"] = backbone_spec(teacher)
        self.blocks = teacher_blocks if variant == "patch_mse" else 1
        if self.blocks > 1 and "last_blocks" not in inspect.signature(
                getattr(self.teacher, "forward_dense", lambda x: x)).parameters:
            raise ValueError(
                f"teacher_blocks={teacher_blocks} needs a teacher with forward_dense(x, "
                f"last_blocks) (ssl_lightning.ViT); {type(self.teacher).__name__} has none. Set "
                "teacher_blocks: 1.")
        size, student_size = teacher_image_size or self.image_size, self.image_size
        teacher_dim = feature_dim(self.teacher, size)
        if variant != "patch_mse":
            self.global_head = nn.Linear(self.feature_dim, teacher_dim)
            self.queue = FeatureQueue(queue_size, teacher_dim)
        if variant != "global":
            with torch.no_grad():
                teacher_channels = self.teacher_features(torch.zeros(2, 3, size, size))[0].shape[1]
            student_channels = dense_channels(self.backbone, student_size)
            self.patch_head = (nn.Linear(student_channels, teacher_channels)
                               if variant == "global_local" else
                               build_mlp(student_channels, head_hidden_dim, teacher_channels,
                                         batch_norm=False, activation=nn.GELU))

    def build_criterion(self) -> nn.Module:
        return DistillationLoss(self.variant, self.temperature, self.local_temperature,
                                self.local_weight)

    def trainable_modules(self) -> list[nn.Module]:
        return [m for m in self.children() if m is not self.teacher]

    def train(self, mode: bool = True) -> Distillation:
        """Set the mode of everything but the teacher, which stays in eval mode."""
        super().train(mode)
        self.teacher.eval()
        return self

    @torch.no_grad()
    def teacher_features(self, x: Tensor) -> tuple[Tensor | None, Tensor]:
        """The teacher's map (None for ``"global"``) and pooled embedding of images ``x``."""
        size = self.teacher_image_size
        if size is not None and tuple(x.shape[-2:]) != (size, size):
            x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
        if self.variant == "global":
            return None, self.teacher(x)
        if self.blocks > 1:
            return self.teacher.forward_dense(x, last_blocks=self.blocks)  # type: ignore[operator]
        return dense_features(self.teacher, x)

    def mix(self, x: Tensor, seed: int) -> Tensor:
        """:func:`global_batch_mixup` of this rank's images (the same pairs on any number of
        processes)."""
        world, rank = layout(self)
        return global_batch_mixup(x, self.gather_no_grad(x), world, rank, seed)

    def training_step(self, batch: Batch, batch_idx: int) -> dict[str, Tensor]:
        views, targets, *seeds = batch
        if self.mixup:
            seed = step_seed(self.rng_seed, self.current_epoch, batch_idx, 0)
            views = [self.mix(views[0], seed), *views[1:]]
        return super().training_step((views, targets, *seeds), batch_idx)

    def forward_views(self, views: Sequence[Tensor]) -> dict[str, Any]:
        self.require_views(views, 1)
        x = views[0]
        teacher_map, teacher_global = self.teacher_features(x)
        outputs: dict[str, Any] = {"teacher_global": teacher_global}
        if teacher_map is None:
            outputs["features"] = self.backbone(x)
        else:
            student_map, outputs["features"] = dense_features(self.backbone, x)
            student_map = F.interpolate(student_map, size=teacher_map.shape[-2:], mode="bilinear",
                                        align_corners=False)
            outputs["student_patches"] = self.patch_head(student_map.flatten(2).transpose(1, 2))
            outputs["teacher_patches"] = teacher_map.flatten(2).transpose(1, 2)
        if self.variant != "patch_mse":
            outputs["student_global"] = self.global_head(outputs["features"])
        return outputs

    def enqueue_teacher(self, teacher_global: Tensor) -> None:
        """Put the normalised teacher embeddings of the whole (gathered) batch in the queue."""
        self.queue.enqueue(F.normalize(self.gather_no_grad(teacher_global), dim=1))

    def loss_from_outputs(self, outputs: dict[str, Any]) -> Tensor:
        queue = None
        if self.variant != "patch_mse":
            self.enqueue_teacher(outputs["teacher_global"])
            queue = self.queue.negatives()
        return self.criterion(outputs.get("student_global"), outputs["teacher_global"], queue,
                              outputs.get("student_patches"), outputs.get("teacher_patches"))

    def teacher_fingerprint(self) -> Tensor:
        """:func:`weight_fingerprint` of the teacher's full weights (gathered from the shards
        under sharded training: every process calls it, as the checkpoint hooks do)."""
        return weight_fingerprint(full_state_dict(self.teacher))

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Leave the teacher out (it is rebuilt on load) and record its fingerprint."""
        super().on_save_checkpoint(checkpoint)
        state: MutableMapping[str, Any] = checkpoint["state_dict"]
        for key in [k for k in state if k.startswith(self.unsaved_state_prefixes)]:
            del state[key]
        checkpoint[FINGERPRINT_KEY] = self.teacher_fingerprint()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Check that the rebuilt teacher is the one trained with, then let the state dict
        load without teacher keys (this teacher's own weights stay)."""
        super().on_load_checkpoint(checkpoint)
        saved, rebuilt = checkpoint.get(FINGERPRINT_KEY), self.teacher_fingerprint()
        if saved is not None and (saved.shape != rebuilt.shape or not
                                  torch.allclose(saved, rebuilt, rtol=1e-6)):
            raise ValueError(
                "The teacher rebuilt for this checkpoint has other weights than the one it was "
                "trained with (the teacher is not stored in checkpoints). Give the same teacher: "
                "the same teacher_checkpoint, or a teacher whose pretrained_path holds the same "
                "weights.")
        state = checkpoint.get("state_dict")  # absent: a sharded strategy loaded the shards
        if state is not None:
            for key, value in self.teacher.state_dict().items():
                state.setdefault(f"teacher.{key}", value)

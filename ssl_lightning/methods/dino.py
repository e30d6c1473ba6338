"""DINO and its family: one self-distillation module whose loss terms are switched by arguments.

DINO (Caron et al., "Emerging Properties in Self-Supervised Vision Transformers", ICCV 2021):
the student (backbone + :class:`DINOHead`) sees all multi-crop views, the EMA teacher only the 2
global ones (Algorithm 1); :class:`DINOLoss` compares them with a centred (or Sinkhorn-Knopp),
sharpened teacher. The other members of the family are the same module with more terms on, as
in DINOv3's ``SSLMetaArch``, where each loss is an option of one class:

- ``patch_distillation``: iBOT's masked-patch loss (:class:`IBOTPatchLoss`; the student's global
  crops are block-masked; iBOT++ with ``patch_visible_weight``), see :mod:`.ibot`;
- ``koleo_weight``: DINOv2's KoLeo regulariser on the student's [CLS] features, see :mod:`.dinov2`;
- ``gram_anchoring``: DINOv3's Gram loss against a Gram teacher, see :mod:`.dinov3`;
- ``matryoshka_levels``: Franca's nested Matryoshka heads (every head and its loss at several
  prototype counts on prefixes of the features), see :mod:`.dinov2_matryoshka`;
- ``paka_weight``: PaKA's patch kernel alignment between the student's and teacher's patch
  tokens, see :mod:`.dinov2_paka`.

:class:`~ssl_lightning.methods.IBOT`, :class:`~ssl_lightning.methods.DINOv2` and
:class:`~ssl_lightning.methods.DINOv3` are presets: subclasses of :class:`DINO` that only change
defaults. The recipe details of the papers' code are arguments: teacher temperature warm-up (per
epoch), last layer frozen during the first epoch(s), per-parameter gradient clipping (or DINOv2's
clip of each module's gradient norm), teacher momentum 0.996 → 1 (cosine, through
:class:`EMACallback`); the cosine weight-decay schedule (0.04 → 0.4) is :class:`SSLMethod`'s
``weight_decay_end``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any, Literal, cast

import torch
from torch import Tensor, nn

from ssl_lightning._lightning import attached_trainer
from ssl_lightning.backbones.multicrop import forward_by_resolution
from ssl_lightning.backbones.rope import RotaryPositionEmbedding
from ssl_lightning.backbones.vit import DropPath
from ssl_lightning.heads import DINOHead, build_mlp
from ssl_lightning.heads.matryoshka import MatryoshkaDINOHead
from ssl_lightning.losses import DINOLoss, GramLoss, IBOTPatchLoss, KoLeoLoss
from ssl_lightning.losses.centering import Centering
from ssl_lightning.losses.gram import ClampNegatives
from ssl_lightning.losses.matryoshka import MatryoshkaLoss
from ssl_lightning.losses.paka import PaKALoss, cross_crop_patches
from ssl_lightning.masking import BlockMasking
from ssl_lightning.methods.momentum import MomentumMethod
from ssl_lightning.methods.registry import MULTI_CROP, Paper, register_method
from ssl_lightning.optim import cosine_ramp, epoch_linspace
from ssl_lightning.training.dino_arguments import (
    ClipMode,
    GramTokens,
    KoLeoScope,
    check_dino_arguments,
)
from ssl_lightning.training.ema import momentum_teacher
from ssl_lightning.training.grad_cache import whole_batch_draw
from ssl_lightning.training.gram_teacher import GramTeacher
from ssl_lightning.training.mixed_resolution import MixedResolution
from ssl_lightning.training.sample_rng import active_keys
from ssl_lightning.training.step_rng import step_seed

__all__ = ["DINO", "ClipMode", "GramTokens", "KoLeoScope"]


@register_method(
    "dino", title="DINO", configs=("dino.yaml",),
    paper=Paper("Emerging Properties in Self-Supervised Vision Transformers", 2021, "2104.14294"),
    family="distillation", views=MULTI_CROP, tests="tests/methods/test_dino.py",
    small=lambda backbone, **kw: DINO(backbone, head_out_dim=12, head_hidden_dim=16,
                                      head_bottleneck_dim=8, clip_grad=0.05, momentum_base=0.9,
                                      warmup_teacher_temperature_epochs=0, **kw),
)
class DINO(MomentumMethod):
    """DINO self-distillation with multi-crop, and the terms of iBOT, DINOv2 and DINOv3.

    Training batches hold ``[global_1, global_2, local_1, ...]`` views
    (:class:`~ssl_lightning.data.multicrop.MultiCropViews`); the number of local crops V is set
    there. With ``patch_distillation`` the backbone must be a :class:`~ssl_lightning.backbones.ViT`
    built with ``mask_token=True``; masks are drawn per sample from the sample's key (batches
    with sample seeds, :mod:`~ssl_lightning.training.sample_rng`), else from torch's RNG
    reseeded per ``(rng_seed, epoch, batch index, rank)``. With ``gram_anchoring`` the views are
    ``[global_1, global_2, local_1 … local_V]`` and, optionally, two Gram-teacher crops of the
    global crops at a higher resolution (:class:`~ssl_lightning.data.gram_crops.GramCropViews`).

    Args:
        backbone: Feature extractor (ViT or ResNet; see :class:`SSLMethod`).
        head_out_dim: Prototypes K (65536 on ImageNet; 4096 is plenty for CIFAR-10).
        head_hidden_dim: Hidden width of the head MLP (2048).
        head_bottleneck_dim: Bottleneck before the last layer (256).
        head_batch_norm: BatchNorm in the head MLP (off for ViTs, as in the paper).
        norm_last_layer: Fix the norm of the last-layer rows to 1 (paper default).
        student_temperature: τ_s (0.1).
        teacher_temperature: Final τ_t after the warm-up (0.04-0.07).
        warmup_teacher_temperature: τ_t at epoch 0 (0.04).
        warmup_teacher_temperature_epochs: Epochs of the linear τ_t warm-up (30 for ViT-S/300 ep):
            ``linspace(warm-up value, final, epochs)``, the final value reached in the last.
        center_momentum: Momentum of the centre EMA (0.9).
        centering: ``"center"`` (EMA centres, DINO and iBOT) or ``"sinkhorn"`` (DINOv2) for the
            [CLS] and patch losses.
        sinkhorn_iterations: Sinkhorn-Knopp rounds (3).
        freeze_last_layer_epochs: Epochs during which the heads' last layers are not updated (1).
        clip_grad: Gradient-norm clip (3.0), or None for no clipping.
        clip_grad_mode: ``"per_parameter"``: each parameter's gradient norm (DINO's code);
            ``"per_module"``: the norm of all gradients of each trainable module (backbone,
            head, iBOT head) together (DINOv2's code).
        momentum_base: Teacher EMA momentum at step 0 (0.996), cosine to ``momentum_end`` (1).
        num_local_crops: Local crops the data must provide (checked before training and at
            every step); None: any number.
        patch_distillation: iBOT's masked-patch loss (:class:`IBOT`): the student's global crops
            are block-masked and predict, at every masked patch, the teacher's patch
            distribution of the unmasked crop. Off: DINO's [CLS] loss alone.
        patch_out_dim: Prototypes of the patch head (None: ``head_out_dim``; must equal it with
            a shared head).
        shared_head: Use the [CLS] head for the patch tokens too (iBOT) or a separate head
            of the same widths (DINOv2).
        patch_hidden_dim: Hidden width of the separate patch head (None: ``head_hidden_dim``;
            DINOv3: 4096 beside the [CLS] head's 8192).
        patch_bottleneck_dim: Bottleneck of the separate patch head (None:
            ``head_bottleneck_dim``; DINOv3: 384 beside 512).
        patch_student_temperature: τ_s of the patch loss (0.1).
        patch_teacher_temperature: Final τ_t of the patch loss (0.07) ...
        warmup_patch_teacher_temperature: ... warmed up from this value (0.04) over
            ``warmup_teacher_temperature_epochs``, like the [CLS] τ_t.
        patch_center_momentum: Momentum of the patch centre (0.9).
        patch_loss_weight: λ of the patch loss (1.0).
        patch_visible_weight: iBOT++ visible-patch weight (0: iBOT).
        mask_ratio: Range of the per-image mask ratio ((0.1, 0.5)).
        mask_probability: Fraction of global-crop images that are masked (0.5).
        mask_min_patches: Smallest masking rectangle in patches (4).
        mask_ratio_stratified: DINOv2's ratios: of the step's global-crop images,
            ``int(n · mask_probability)`` are masked, with ratios from consecutive equal slices
            of ``mask_ratio`` in a random order drawn from the step seed (the same on every
            rank; docs/ibot_dinov2.md). False: each image is masked with ``mask_probability``
            and a uniform ratio (iBOT).
        koleo_weight: Weight of DINOv2's KoLeo term on the student's L2-normalised [CLS]
            backbone features of each global crop (DINOv2: 0.1); 0 disables it.
        koleo_scope: ``"global"`` (neighbours among all ranks' samples: N processes equal one)
            or ``"local"`` (each rank's own batch, like the official code).
        gram_anchoring: DINOv3's Gram anchoring (:class:`DINOv3`): a Gram teacher (a snapshot
            of the EMA teacher) and :class:`~ssl_lightning.losses.GramLoss` on the student's
            patch tokens; needs ``patch_distillation`` and ``num_local_crops``.
        gram_weight: Weight of the Gram loss once ramped up (2.0 in the Gram stage, 1.5 in
            the high-resolution stage); 0 switches the loss off.
        gram_start_step: Optimiser step of the first Gram-teacher snapshot; the Gram loss is
            off before it.
        gram_refresh_every: Steps between Gram-teacher refreshes (10,000); 0: never.
        gram_max_refreshes: Most refreshes (3); None: no limit.
        gram_weight_ramp_steps: Steps of the cosine ramp 0 → ``gram_weight`` after the start.
        gram_tokens: Patches in the Gram matrices: ``"all"`` (DINOv3), ``"masked"`` or
            ``"unmasked"`` (by the student's iBOT mask).
        gram_clamp_negatives: ``"none"`` (DINOv3), ``"both"`` or ``"teacher"``.
        mixed_resolution_sizes: ``[global, local, gram]`` crop sides, one set drawn per step
            (DINOv3's high-resolution stage, :class:`~ssl_lightning.training.mixed_resolution.
            MixedResolution`); needs ``num_local_crops``; None: the data's sizes.
        mixed_resolution_ratios: Frequency of each set (default: equal).
        matryoshka_levels: Franca's nested heads: L > 1 replaces each head by
            :class:`~ssl_lightning.heads.matryoshka.MatryoshkaDINOHead` (L heads on the feature
            prefixes D/2^(L-1) … D with K/2^(L-1) … K prototypes) and each loss by the sum of
            the levels' losses (:class:`~ssl_lightning.losses.matryoshka.MatryoshkaLoss`);
            Franca: 5. 1: one head.
        paka_weight: Weight of PaKA's patch kernel alignment
            (:class:`~ssl_lightning.losses.paka.PaKALoss`) between the student's patch tokens
            of its (masked) global crops and the teacher's of the unmasked crops, both through
            a PaKA projection MLP (EMA for the teacher); needs ``patch_distillation``; 0: off.
        paka_hidden_dim: Hidden width of the 3-layer PaKA MLP (2048, lightly-train).
        paka_dim: Output width of the PaKA MLP (256, lightly-train).
        paka_views: ``"same"``: PaKA on the global crops (student masked, teacher unmasked);
            ``"across"``: lightly-train ``dinov31``'s cross-crop form, each of
            ``paka_local_crops`` student local crops against the teacher's augmentation-free
            global crop it lies in, both RoI-aligned onto the local crop's patch grid over the
            region they share (:func:`~ssl_lightning.losses.paka.cross_crop_patches`); needs
            ``train_transform: PaKAViews``.
        paka_local_crops: The PaKA local crops per image with ``paka_views: across`` (8).
        **kwargs: Other arguments of :class:`MomentumMethod` / :class:`SSLMethod`, e.g.
            ``weight_decay_end`` (the paper's 0.04 → 0.4 cosine schedule with AdamW).
    """

    views_used = None  # every multi-crop view

    def __init__(
        self,
        backbone: nn.Module,
        head_out_dim: int = 65536,
        head_hidden_dim: int = 2048,
        head_bottleneck_dim: int = 256,
        head_batch_norm: bool = False,
        norm_last_layer: bool = True,
        student_temperature: float = 0.1,
        teacher_temperature: float = 0.07,
        warmup_teacher_temperature: float = 0.04,
        warmup_teacher_temperature_epochs: int = 30,
        center_momentum: float = 0.9,
        centering: Centering = "center",
        sinkhorn_iterations: int = 3,
        freeze_last_layer_epochs: int = 1,
        clip_grad: float | None = 3.0,
        clip_grad_mode: ClipMode = "per_parameter",
        momentum_base: float = 0.996,
        num_local_crops: int | None = None,
        patch_distillation: bool = False,
        patch_out_dim: int | None = None,
        shared_head: bool = True,
        patch_hidden_dim: int | None = None,
        patch_bottleneck_dim: int | None = None,
        patch_student_temperature: float = 0.1,
        patch_teacher_temperature: float = 0.07,
        warmup_patch_teacher_temperature: float = 0.04,
        patch_center_momentum: float = 0.9,
        patch_loss_weight: float = 1.0,
        patch_visible_weight: float = 0.0,
        mask_ratio: tuple[float, float] = (0.1, 0.5),
        mask_probability: float = 0.5,
        mask_min_patches: int = 4,
        mask_ratio_stratified: bool = False,
        koleo_weight: float = 0.0,
        koleo_scope: KoLeoScope = "global",
        gram_anchoring: bool = False,
        gram_weight: float = 2.0,
        gram_start_step: int = 0,
        gram_refresh_every: int = 10000,
        gram_max_refreshes: int | None = 3,
        gram_weight_ramp_steps: int = 0,
        gram_tokens: GramTokens = "all",
        gram_clamp_negatives: ClampNegatives = "none",
        mixed_resolution_sizes: list[list[int]] | None = None,
        mixed_resolution_ratios: list[float] | None = None,
        matryoshka_levels: int = 1,
        paka_weight: float = 0.0,
        paka_hidden_dim: int = 2048,
        paka_dim: int = 256,
        paka_views: Literal["same", "across"] = "same",
        paka_local_crops: int = 8,
        **kwargs: Any,
    ) -> None:
        arguments = {k: v for k, v in locals().items() if k not in ("self", "backbone", "kwargs",
                                                                    "__class__")}
        check_dino_arguments(type(self).__name__, backbone, {**arguments, **kwargs},
                             {n: p.default for n, p in _SIGNATURE.parameters.items()})
        mixed = (None if mixed_resolution_sizes is None else MixedResolution(  # before the heads
            mixed_resolution_sizes, mixed_resolution_ratios,
            patch_size=getattr(backbone, "patch_size", None)))
        super().__init__(backbone, momentum_base=momentum_base, **kwargs)
        self.head_out_dim, self.student_temperature = head_out_dim, student_temperature
        self.center_momentum = center_momentum
        self.centering, self.sinkhorn_iterations = centering, sinkhorn_iterations
        self.teacher_temperatures = (warmup_teacher_temperature, teacher_temperature)
        self.warmup_teacher_temperature_epochs = warmup_teacher_temperature_epochs
        self.freeze_last_layer_epochs = freeze_last_layer_epochs
        self.clip_grad, self.clip_grad_mode = clip_grad, clip_grad_mode
        self.num_local_crops = num_local_crops
        self.patch_distillation = patch_distillation
        self.patch_teacher_temperatures = (warmup_patch_teacher_temperature,
                                           patch_teacher_temperature)
        self.patch_loss_weight = patch_loss_weight
        self.mask_ratio_stratified = mask_ratio_stratified
        self.koleo_weight, self.koleo_scope = koleo_weight, koleo_scope
        self.gram_anchoring, self.gram_tokens = gram_anchoring, gram_tokens
        self.gram_weight_max, self.gram_start_step = gram_weight, gram_start_step
        self.gram_weight_ramp_steps = gram_weight_ramp_steps
        self.matryoshka_levels, self.paka_weight = matryoshka_levels, paka_weight
        self.paka_views, self.paka_local_crops = paka_views, paka_local_crops

        self.head = self.prototype_head(head_out_dim, head_hidden_dim, head_bottleneck_dim,
                                        head_batch_norm, norm_last_layer)
        self.teacher_backbone = momentum_teacher(self.backbone)
        for module in self.teacher_backbone.modules():
            if isinstance(module, DropPath):  # the paper's teacher has no stochastic depth
                module.drop_prob = 0.0
            elif isinstance(module, RotaryPositionEmbedding):  # DINOv3: nor RoPE augmentation
                module.shift, module.jitter, module.rescale = 0.0, 1.0, 1.0
        self.teacher_head = momentum_teacher(self.head)
        self.patch_head: nn.Module | None = None
        self.teacher_patch_head: nn.Module | None = None
        if patch_distillation:
            self.masking = BlockMasking(mask_ratio, mask_probability, mask_min_patches)
            patch_dim = patch_out_dim or head_out_dim
            if not shared_head:
                self.patch_head = self.prototype_head(
                    patch_dim, patch_hidden_dim or head_hidden_dim,
                    patch_bottleneck_dim or head_bottleneck_dim, False, norm_last_layer)
                self.teacher_patch_head = momentum_teacher(self.patch_head)
            self.patch_criterion = self.level_losses(
                self.patch_head or self.head, patch_dim,
                lambda k: IBOTPatchLoss(k, patch_student_temperature, patch_center_momentum,
                                        centering, sinkhorn_iterations, patch_visible_weight))
        self.paka_head: nn.Module | None = None
        self.teacher_paka_head: nn.Module | None = None
        if paka_weight > 0:
            self.paka_head = build_mlp(self.feature_dim, paka_hidden_dim, paka_dim, 3,
                                       batch_norm=False, activation=nn.GELU)
            self.teacher_paka_head = momentum_teacher(self.paka_head)
            self.paka_loss = PaKALoss()
        self.koleo = KoLeoLoss() if koleo_weight > 0 else None
        self.mixed_resolution = mixed
        self.step_sizes: tuple[int, int, int] | None = None
        self.gram_teacher: GramTeacher | None = None
        if gram_anchoring:
            self.gram_loss = GramLoss(clamp_negatives=gram_clamp_negatives)
            self.gram_teacher = GramTeacher(self.teacher_backbone, gram_start_step,
                                            gram_refresh_every, gram_max_refreshes)

    def build_criterion(self) -> nn.Module:
        """DINO's [CLS] loss with this method's ``centering`` (centre or Sinkhorn), one per
        Matryoshka level."""
        return self.level_losses(self.head, self.head_out_dim, lambda k: DINOLoss(
            k, self.student_temperature, self.center_momentum, self.centering,
            self.sinkhorn_iterations))

    def prototype_head(self, out_dim: int, hidden_dim: int, bottleneck_dim: int,
                       batch_norm: bool, norm_last_layer: bool) -> nn.Module:
        """A :class:`DINOHead`, or Franca's nested heads with ``matryoshka_levels`` > 1."""
        if self.matryoshka_levels > 1:
            return MatryoshkaDINOHead(self.feature_dim, out_dim, hidden_dim, bottleneck_dim,
                                      self.matryoshka_levels, norm_last_layer)
        return DINOHead(self.feature_dim, out_dim, hidden_dim, bottleneck_dim,
                        batch_norm=batch_norm, norm_last_layer=norm_last_layer)

    @staticmethod
    def level_losses(head: nn.Module, out_dim: int,
                     make: Callable[[int], nn.Module]) -> nn.Module:
        """``make(out_dim)``, or for Matryoshka heads the sum of ``make(K_l)`` over levels."""
        if isinstance(head, MatryoshkaDINOHead):
            return MatryoshkaLoss([make(size) for size in head.out_sizes], head.out_sizes)
        return make(out_dim)

    def ema_pairs(self) -> list[tuple[nn.Module, nn.Module]]:
        pairs = [(self.backbone, self.teacher_backbone), (self.head, self.teacher_head)]
        for student, teacher in ((self.patch_head, self.teacher_patch_head),
                                 (self.paka_head, self.teacher_paka_head)):
            if student is not None and teacher is not None:
                pairs.append((student, teacher))
        return pairs

    def trainable_modules(self) -> list[nn.Module]:
        return [m for m in super().trainable_modules() if m is not self.gram_teacher]

    # --------------------------------------------------------------------------- schedules
    def teacher_temperature(self, epoch: int) -> float:
        """τ_t of ``epoch``: the official per-epoch linear space from the warm-up value to the
        final one over ``warmup_teacher_temperature_epochs``, then constant."""
        return epoch_linspace(epoch, self.warmup_teacher_temperature_epochs,
                              *self.teacher_temperatures)

    def patch_teacher_temperature(self, epoch: int) -> float:
        """Patch τ_t of ``epoch``: the [CLS] warm-up schedule between the patch values."""
        return epoch_linspace(epoch, self.warmup_teacher_temperature_epochs,
                              *self.patch_teacher_temperatures)

    def gram_weight(self, step: int) -> float:
        """Weight of the Gram loss at optimiser step ``step``: 0 without Gram anchoring or
        before ``gram_start_step``, then a cosine ramp to ``gram_weight`` over
        ``gram_weight_ramp_steps``."""
        start, ramp = self.gram_start_step, self.gram_weight_ramp_steps
        if not self.gram_anchoring or step < start:
            return 0.0
        if ramp == 0:
            return self.gram_weight_max
        return cosine_ramp(step - start, ramp, 0.0, self.gram_weight_max)

    def refresh_gram_teacher(self, step: int) -> bool:
        """Snapshot the EMA teacher into the Gram teacher if ``step`` is on its schedule."""
        return self.gram_teacher is not None and self.gram_teacher.refresh(
            step, self.teacher_backbone)

    # ------------------------------------------------------------------------------ forward
    def draw_masks(self, batch: int, grid: tuple[int, int]) -> Tensor:
        """Block masks (B, 2, grid_h · grid_w) for the two global crops: from each sample's key
        inside a keyed forward, else from torch's RNG (stratified over this rank's batch; once
        for the whole batch under gradient caching)."""
        keys, stratified = active_keys(), self.mask_ratio_stratified
        if keys is None:
            def draw(n: int) -> Tensor:
                order = torch.randperm(2 * n) if stratified else None
                masks = self.masking(2 * n, grid, order=order, total=2 * n)
                return masks.view(2, n, -1).transpose(0, 1)

            return whole_batch_draw("ibot_masks", batch, draw)
        seeds = torch.cat([keys.streams(crop) for crop in range(2)]).cpu()
        order = keys.global_order(2, stream=0).flatten() if stratified else None
        masks = self.masking(2 * batch, grid, seeds, order, 2 * keys.global_batch)
        return masks.view(2, batch, -1).transpose(0, 1)

    def forward_views(self, views: Sequence[Tensor]) -> dict[str, Any]:
        if self.paka_weight > 0 and self.paka_views == "across":
            n_views = 2 + int(self.num_local_crops or 0)
            expected = n_views + 4 + 2 * self.paka_local_crops
            if len(views) != expected:
                raise ValueError(
                    f"{type(self).__name__} with paka_views: across needs {n_views} DINO views, "
                    f"2 clean global crops, {self.paka_local_crops} PaKA crops and their "
                    f"{2 + self.paka_local_crops} boxes ({expected} entries), got {len(views)}: "
                    "use train_transform: PaKAViews with the same num_local_crops and "
                    "paka_local_crops.")
            outputs = self.forward_masked(views[:n_views])
            outputs.update(self.forward_paka_across(views[n_views:]))
            return outputs
        gram_crops: Sequence[Tensor] = ()
        if self.gram_anchoring:
            n_views = 2 + int(self.num_local_crops or 0)
            if len(views) not in (n_views, n_views + 2):
                raise ValueError(f"{type(self).__name__} needs 2 global + {n_views - 2} local "
                                 f"views (+ 2 Gram-teacher crops), got {len(views)} views.")
        if self.step_sizes is not None:
            views = MixedResolution.resize(views, int(self.num_local_crops or 0), self.step_sizes)
        if self.gram_anchoring:
            views, gram_crops = views[:n_views], views[n_views:]
        if not self.patch_distillation:
            return self.forward_cls(views)
        outputs = self.forward_masked(views)
        if self.gram_weight(self.global_step) > 0:
            patch = cast(Any, self.backbone).patch_size
            grid = (views[0].shape[-2] // patch, views[0].shape[-1] // patch)
            outputs["gram_teacher_patches"] = torch.stack(  # (B, 2, N, D), per sample
                [self.gram_teacher.patch_features(c, grid)  # type: ignore[union-attr]
                 for c in (gram_crops or views[:2])], dim=1)
        return outputs

    def forward_cls(self, views: Sequence[Tensor]) -> dict[str, Any]:
        """DINO's forward: the student on every view, the teacher on the 2 global ones."""
        if len(views) < 2:
            raise ValueError(f"DINO needs 2 global views (+ local views), got {len(views)}.")
        self.check_view_count(views)
        batch = views[0].shape[0]
        with torch.no_grad():
            teacher_out = self.teacher_head(forward_by_resolution(self.teacher_backbone, views[:2]))
        features = forward_by_resolution(self.backbone, views)
        student_out = self.head(features)
        outputs = {"student": list(student_out.chunk(len(views))),
                   "teacher": list(teacher_out.chunk(2)), "features": features[:batch]}
        if self.koleo is not None:
            outputs["global_features"] = features[:2 * batch].unflatten(0, (2, batch)
                                                                        ).transpose(0, 1)
        return outputs

    def check_view_count(self, views: Sequence[Tensor]) -> None:
        """``ValueError`` when the views are not 2 global + ``num_local_crops`` local ones."""
        expected = self.num_local_crops
        if len(views) < 2 or (expected is not None and len(views) != 2 + expected):
            want = "2 global + any number of local" if expected is None else f"2 + {expected}"
            raise ValueError(f"{type(self).__name__} needs {want} views, got {len(views)}.")

    def forward_masked(self, views: Sequence[Tensor]) -> dict[str, Any]:
        """iBOT's forward: the student on its block-masked global crops (tokens) and the local
        crops, the teacher on the unmasked global crops; outputs per sample (B, V, ...)."""
        self.check_view_count(views)
        if views[0].shape != views[1].shape:
            raise ValueError(f"The 2 global views must have one shape, got "
                             f"{tuple(views[0].shape)} and {tuple(views[1].shape)}.")
        vit: Any = self.backbone
        batch, patch, prefix = views[0].shape[0], vit.patch_size, vit.num_prefix_tokens
        crops = torch.cat(list(views[:2]))
        grid = (crops.shape[-2] // patch, crops.shape[-1] // patch)
        masks = self.draw_masks(batch, grid).to(crops.device)
        tokens = vit.forward_tokens(crops, mask=masks.transpose(0, 1).flatten(0, 1))
        student_cls = self.head(tokens[:, 0])
        if len(views) > 2:
            local = self.head(forward_by_resolution(self.backbone, views[2:]))
            student_cls = torch.cat([student_cls, local])
        student_patch = (self.patch_head or self.head)(tokens[:, prefix:])
        with torch.no_grad():
            teacher_tokens = self.teacher_backbone.forward_tokens(crops)  # type: ignore[operator]
            teacher_cls = self.teacher_head(teacher_tokens[:, 0])
            teacher_patch = (self.teacher_patch_head or self.teacher_head)(
                teacher_tokens[:, prefix:])

        def per_sample(x: Tensor) -> Tensor:  # (V·B, ...) view-major -> (B, V, ...)
            return x.unflatten(0, (-1, batch)).transpose(0, 1)

        outputs = {"student_cls": per_sample(student_cls),
                   "teacher_cls": per_sample(teacher_cls),
                   "student_patch": per_sample(student_patch),
                   "teacher_patch": per_sample(teacher_patch), "masks": masks,
                   "patch_tokens": per_sample(tokens[:, prefix:]),
                   "global_features": per_sample(tokens[:, 0]), "features": tokens[:batch, 0]}
        if self.paka_head is not None and self.teacher_paka_head is not None \
                and self.paka_views == "same":
            outputs["paka_student"] = per_sample(self.paka_head(tokens[:, prefix:]))
            with torch.no_grad():
                outputs["paka_teacher"] = per_sample(
                    self.teacher_paka_head(teacher_tokens[:, prefix:]))
        return outputs

    def forward_paka_across(self, entries: Sequence[Tensor]) -> dict[str, Tensor]:
        """PaKA across crops (``paka_views: across``) on ``[clean_1, clean_2, paka_1..K,
        box_g1, box_g2, box_p1..K]`` of :class:`~ssl_lightning.data.paka_views.PaKAViews`: the
        student on the PaKA crops, the teacher on the clean global crops, crop k paired with
        global crop k mod 2; per sample (B, K, N, D) projections and (B, K) valid pairs."""
        k = self.paka_local_crops
        clean, crops, boxes = entries[:2], entries[2:2 + k], entries[2 + k:]
        vit: Any = self.backbone
        prefix, patch = vit.num_prefix_tokens, vit.patch_size

        def patch_map(tokens: Tensor, image: Tensor) -> Tensor:  # (n, C, h, w)
            grid = (image.shape[-2] // patch, image.shape[-1] // patch)
            return tokens[:, prefix:].transpose(1, 2).unflatten(2, grid)

        with torch.no_grad():
            teacher = patch_map(self.teacher_backbone.forward_tokens(  # type: ignore[operator]
                torch.cat(list(clean))), clean[0]).chunk(2)
        student = patch_map(vit.forward_tokens(torch.cat(list(crops))), crops[0]).chunk(k)
        pairs = [cross_crop_patches(student[j], boxes[2 + j], teacher[j % 2], boxes[j % 2])
                 for j in range(k)]
        head, teacher_head = cast(nn.Module, self.paka_head), cast(nn.Module,
                                                                   self.teacher_paka_head)
        outputs = {"paka_student": head(torch.stack([p[0] for p in pairs], dim=1)),
                   "paka_valid": torch.stack([p[2] for p in pairs], dim=1)}
        with torch.no_grad():
            outputs["paka_teacher"] = teacher_head(
                torch.stack([p[1] for p in pairs], dim=1))
        return outputs

    # --------------------------------------------------------------------------------- loss
    def loss_from_outputs(self, outputs: dict[str, Any]) -> Tensor:
        """The [CLS] loss, plus each term that is on: patch, KoLeo, PaKA, Gram."""
        epoch = self.current_epoch
        if not self.patch_distillation:
            temperature = self.teacher_temperature(epoch)
            loss = self.criterion(outputs["student"], outputs["teacher"], temperature)
            if attached_trainer(self) is not None:
                self.log("train/teacher_temperature", temperature, on_step=False, on_epoch=True)
        else:
            cls_loss = self.criterion(outputs["student_cls"].unbind(1),
                                      outputs["teacher_cls"].unbind(1),
                                      self.teacher_temperature(epoch))
            patch_loss = self.patch_criterion(outputs["student_patch"], outputs["teacher_patch"],
                                              outputs["masks"],
                                              self.patch_teacher_temperature(epoch))
            self.log_terms(cls_loss=cls_loss, patch_loss=patch_loss,
                           mask_ratio=outputs["masks"].float().mean(),
                           teacher_temperature=self.teacher_temperature(epoch))
            loss = cls_loss + self.patch_loss_weight * patch_loss
        if self.koleo_weight != 0:
            koleo = self.koleo_loss(outputs["global_features"])
            self.log_terms(koleo=koleo)
            loss = loss + self.koleo_weight * koleo
        if self.paka_weight != 0:
            paka = self.paka_loss(outputs["paka_student"], outputs["paka_teacher"],
                                  outputs.get("paka_valid"))
            self.log_terms(paka_loss=paka)
            loss = loss + self.paka_weight * paka
        weight = self.gram_weight(self.global_step)
        if weight != 0:
            tokens = self.gram_tokens
            masks = outputs["masks"].flatten(0, 1)
            token_mask = None if tokens == "all" else masks if tokens == "masked" else ~masks
            gram = self.gram_loss(outputs["patch_tokens"].flatten(0, 1),
                                  outputs["gram_teacher_patches"].flatten(0, 1), token_mask)
            self.log_terms(gram_loss=gram, gram_weight=weight)
            loss = loss + weight * gram
        return loss

    def koleo_loss(self, global_features: Tensor) -> Tensor:
        """Sum over the global crops of KoLeo on the student [CLS] features (B, 2, D)."""
        assert self.koleo is not None
        total = global_features.new_zeros(())
        for local in global_features.unbind(1):
            if self.koleo_scope == "global":
                total = total + self.koleo(local, self.gather(local),
                                           self.rank_offset(local.shape[0]))
            else:
                total = total + self.koleo(local)
        return total

    def log_terms(self, **terms: Tensor | float) -> None:
        """Log ``train/<name>`` epoch means (when a trainer is attached)."""
        if attached_trainer(self) is not None:
            for key, value in terms.items():
                self.log(f"train/{key}", value, on_step=False, on_epoch=True)

    # ------------------------------------------------------------- optimiser-step adjustments
    def adjust_gradients_(self, epoch: int) -> None:
        """Clip the gradients (``clip_grad_mode``), then drop the last layers' gradients while
        they are frozen."""
        clip = self.clip_grad
        if clip is not None and self.clip_grad_mode == "per_module":
            for module in self.trainable_modules():
                grads = [p for p in module.parameters() if p.requires_grad and p.grad is not None]
                if grads:
                    torch.nn.utils.clip_grad_norm_(grads, clip)
        elif clip is not None:
            for p in self.trainable_parameters():
                if p.grad is not None:
                    scale = clip / (torch.linalg.vector_norm(p.grad) + 1e-6)
                    p.grad.mul_(scale.clamp(max=1.0))
        if epoch < self.freeze_last_layer_epochs:
            for head in (self.head, self.patch_head):
                for p in cast(Any, head).last_layer_parameters() if head is not None else ():
                    p.grad = None  # skipped by the optimiser: no momentum, no weight decay

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for m in self.trainable_modules() for p in m.parameters() if p.requires_grad]

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.adjust_gradients_(self.current_epoch)
        super().on_before_optimizer_step(optimizer)  # the weight-decay schedule

    # ------------------------------------------------------------------------ Lightning hooks
    def on_fit_start(self) -> None:
        """Fail before the first step when the data module's crops do not match
        ``num_local_crops`` (or, across crops, ``paka_local_crops``) or are smaller than the
        mixed-resolution sizes."""
        super().on_fit_start()
        transform = getattr(getattr(self.trainer, "datamodule", None), "train_transform", None)
        expected, actual = self.num_local_crops, getattr(transform, "num_local_crops", None)
        if expected is not None and actual is not None and actual != expected:
            raise ValueError(f"{type(self).__name__} expects num_local_crops={expected} but the "
                             f"data's train_transform makes {actual}; set them equal.")
        across = self.paka_weight > 0 and self.paka_views == "across"
        paka_crops = getattr(transform, "paka_local_crops", None)
        if transform is not None and across and paka_crops != self.paka_local_crops:
            raise ValueError(
                f"{type(self).__name__} with paka_views: across expects "
                f"paka_local_crops={self.paka_local_crops} PaKA crops, but the data's "
                f"train_transform is {type(transform).__name__}"
                + ("" if paka_crops is None else f" with paka_local_crops={paka_crops}")
                + ": use train_transform PaKAViews with the same paka_local_crops.")
        if self.mixed_resolution is not None and transform is not None:
            self.mixed_resolution.check_crops([getattr(transform, f"{n}_size", None)
                                               for n in ("global", "local", "gram")])

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Reseed (see :class:`SSLMethod`), then refresh the Gram teacher on its schedule (the
        EMA update of the previous step is done and ``global_step`` counts it), and draw the
        step's mixed-resolution sizes."""
        super().on_train_batch_start(batch, batch_idx)
        self.refresh_gram_teacher(self.global_step)
        if self.mixed_resolution is not None:
            seed = step_seed(self.rng_seed, self.current_epoch, batch_idx, 0)  # rank-free
            self.step_sizes = self.mixed_resolution.draw(seed)


_SIGNATURE = inspect.signature(DINO.__init__)

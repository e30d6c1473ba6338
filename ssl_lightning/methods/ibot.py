"""iBOT: Zhou et al., "iBOT: Image BERT Pre-Training with Online Tokenizer", ICLR 2022.

DINO (:class:`~ssl_lightning.methods.dino.DINO`: multi-crop, EMA teacher, teacher temperature
warm-up, frozen last layer, clipping, weight-decay schedule) plus masked image modelling: the
student sees its two global crops with blockwise-masked patches replaced by the ViT's learned
mask token and, at every masked position, predicts the teacher's patch distribution of the
unmasked crop (:class:`~ssl_lightning.losses.IBOTPatchLoss`, own centre and temperatures). The
[CLS] loss is DINO's over all crop pairs, with the student's [CLS] of the masked global crops
(§3.3). Patch tokens go through the [CLS] head (``shared_head``, iBOT's ViT-S/B recipe) or a
separate head. Total loss: ``L_cls + patch_loss_weight · L_patch`` (λ = 1).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import Tensor, nn

from ssl_lightning.backbones.multicrop import forward_by_resolution
from ssl_lightning.heads import DINOHead
from ssl_lightning.losses import DINOLoss, IBOTPatchLoss
from ssl_lightning.losses.centering import Centering
from ssl_lightning.masking import BlockMasking
from ssl_lightning.methods.base import SSLMethod
from ssl_lightning.methods.dino import DINO
from ssl_lightning.methods.registry import Paper, register_method, small_vit
from ssl_lightning.optim import epoch_linspace
from ssl_lightning.training.ema import momentum_teacher
from ssl_lightning.training.grad_cache import whole_batch_draw
from ssl_lightning.training.sample_rng import active_keys


@register_method(
    "ibot", title="iBOT", configs=("ibot.yaml", "ibot_plus_plus.yaml"),
    paper=Paper("iBOT: Image BERT Pre-Training with Online Tokenizer", 2022, "2111.07832"),
    family="distillation", views=(8, 8, 4), tests="tests/methods/test_ibot_dinov2.py",
    docs="docs/ibot_dinov2.md",
    backbone=lambda: small_vit(mask_token=True),
    small=lambda backbone, **kw: IBOT(backbone, head_out_dim=12, head_hidden_dim=16,
                                      head_bottleneck_dim=8, momentum_base=0.9,
                                      warmup_teacher_temperature_epochs=0, shared_head=False,
                                      patch_out_dim=12, num_local_crops=1, image_size=8, **kw),
)
class IBOT(DINO):
    """iBOT self-distillation on [CLS] and masked patch tokens.

    The backbone must be a :class:`~ssl_lightning.backbones.ViT` built with ``mask_token=True``.
    Masks are drawn in :meth:`forward_views` per sample, from the sample's key (batches with
    sample seeds, :mod:`~ssl_lightning.training.sample_rng`): 1 process, N processes and
    micro-batches mask the same patches of a sample, and a resumed run the same as an
    uninterrupted one. Batches without seeds draw from torch's RNG, reseeded per
    ``(rng_seed, epoch, batch index, rank)``.

    Args:
        backbone: A ViT with ``forward_tokens`` and a mask token.
        head_out_dim: Prototypes K of the [CLS] head (8192 in iBOT).
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
        centering: ``"center"`` (EMA centres, iBOT) or ``"sinkhorn"`` (DINOv2) for both losses.
        sinkhorn_iterations: Sinkhorn-Knopp rounds (3).
        mask_ratio: Range of the per-image mask ratio ((0.1, 0.5)).
        mask_probability: Fraction of global-crop images that are masked (0.5).
        mask_min_patches: Smallest masking rectangle in patches (4).
        mask_ratio_stratified: DINOv2's ratios: of the step's global-crop images,
            ``int(n · mask_probability)`` are masked, with ratios from consecutive equal slices
            of ``mask_ratio`` in a random order drawn from the step seed (the same on every
            rank; docs/ibot_dinov2.md). False: each image is masked with ``mask_probability``
            and a uniform ratio (iBOT).
        num_local_crops: Local crops the data must provide (checked before training and at
            every step); None: any number.
        **kwargs: Other arguments of :class:`DINO` (head widths, temperatures, schedules, ...).
    """

    def __init__(
        self,
        backbone: nn.Module,
        head_out_dim: int = 8192,
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
        centering: Centering = "center",
        sinkhorn_iterations: int = 3,
        mask_ratio: tuple[float, float] = (0.1, 0.5),
        mask_probability: float = 0.5,
        mask_min_patches: int = 4,
        mask_ratio_stratified: bool = False,
        num_local_crops: int | None = None,
        **kwargs: Any,
    ) -> None:
        name = type(self).__name__
        if not all(hasattr(backbone, a) for a in ("forward_tokens", "num_prefix_tokens")):
            raise ValueError(f"{name} needs a ViT backbone with patch tokens (ssl_lightning.ViT),"
                             f" got {type(backbone).__name__}.")
        if getattr(backbone, "mask_token", None) is None:
            raise ValueError(f"{name} needs a ViT built with mask_token=True (the student's "
                             "masked patches are replaced by it); set backbone mask_token: true.")
        if kwargs.get("head_batch_norm"):
            raise ValueError(f"{name} heads also run on patch tokens: head_batch_norm must be "
                             "false.")
        if shared_head and (patch_hidden_dim, patch_bottleneck_dim) != (None, None):
            raise ValueError("A shared head has one size: patch_hidden_dim and "
                             "patch_bottleneck_dim must be None (or set shared_head: false).")
        if shared_head and patch_out_dim not in (None, head_out_dim):
            raise ValueError(f"A shared head has one output size: patch_out_dim ({patch_out_dim})"
                             f" must be None or equal head_out_dim ({head_out_dim}).")
        for arg, value in (("patch_teacher_temperature", patch_teacher_temperature),
                           ("warmup_patch_teacher_temperature", warmup_patch_teacher_temperature)):
            if not value > 0:
                raise ValueError(f"{arg} must be > 0, got {value}.")
        if patch_loss_weight < 0:
            raise ValueError(f"patch_loss_weight must be >= 0, got {patch_loss_weight}.")
        if not 0 <= mask_ratio[0] <= mask_ratio[1] <= 1:
            raise ValueError(f"mask_ratio must satisfy 0 <= low <= high <= 1, got {mask_ratio}.")
        if not 0 <= mask_probability <= 1:
            raise ValueError(f"mask_probability must be in [0, 1], got {mask_probability}.")
        if mask_min_patches < 1:
            raise ValueError(f"mask_min_patches must be >= 1, got {mask_min_patches}.")
        if num_local_crops is not None and num_local_crops < 0:
            raise ValueError(f"num_local_crops must be >= 0 or None, got {num_local_crops}.")
        super().__init__(backbone, head_out_dim=head_out_dim, **kwargs)
        self.masking = BlockMasking(mask_ratio, mask_probability, mask_min_patches)
        hp = self.hparams
        patch_dim = patch_out_dim or head_out_dim
        self.patch_head: DINOHead | None = None
        self.teacher_patch_head: nn.Module | None = None
        if not shared_head:
            self.patch_head = DINOHead(self.feature_dim, patch_dim,
                                       patch_hidden_dim or hp["head_hidden_dim"],
                                       patch_bottleneck_dim or hp["head_bottleneck_dim"],
                                       norm_last_layer=hp["norm_last_layer"])
            self.teacher_patch_head = momentum_teacher(self.patch_head)
        self.patch_criterion = IBOTPatchLoss(patch_dim, patch_student_temperature,
                                             patch_center_momentum, centering,
                                             sinkhorn_iterations, patch_visible_weight)

    training_loss = SSLMethod.training_loss  # the forward_views / loss_from_outputs seam

    def build_criterion(self) -> nn.Module:
        """DINO's [CLS] loss with this method's ``centering`` (centre or Sinkhorn)."""
        hp = self.hparams
        return DINOLoss(hp["head_out_dim"], hp["student_temperature"], hp["center_momentum"],
                        hp["centering"], hp["sinkhorn_iterations"])

    def ema_pairs(self) -> list[tuple[nn.Module, nn.Module]]:
        pairs = super().ema_pairs()
        if self.patch_head is not None and self.teacher_patch_head is not None:
            pairs.append((self.patch_head, self.teacher_patch_head))
        return pairs

    def patch_teacher_temperature(self, epoch: int) -> float:
        """Patch τ_t of ``epoch``: the [CLS] warm-up schedule between the patch values."""
        hp = self.hparams
        return epoch_linspace(epoch, hp["warmup_teacher_temperature_epochs"],
                              hp["warmup_patch_teacher_temperature"],
                              hp["patch_teacher_temperature"])

    def draw_masks(self, batch: int, grid: tuple[int, int]) -> Tensor:
        """Block masks (B, 2, grid_h · grid_w) for the two global crops: from each sample's key
        inside a keyed forward, else from torch's RNG (stratified over this rank's batch; once
        for the whole batch under gradient caching)."""
        keys, stratified = active_keys(), self.hparams["mask_ratio_stratified"]
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
        expected = self.hparams["num_local_crops"]
        if len(views) < 2 or (expected is not None and len(views) != 2 + expected):
            want = "2 global + any number of local" if expected is None else f"2 + {expected}"
            raise ValueError(f"{type(self).__name__} needs {want} views, got {len(views)}.")
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
            teacher_tokens = cast(Any, self.teacher_backbone).forward_tokens(crops)
            teacher_cls = self.teacher_head(teacher_tokens[:, 0])
            teacher_patch = (self.teacher_patch_head or self.teacher_head)(
                teacher_tokens[:, prefix:])

        def per_sample(x: Tensor) -> Tensor:  # (V·B, ...) view-major -> (B, V, ...)
            return x.unflatten(0, (-1, batch)).transpose(0, 1)

        return {"student_cls": per_sample(student_cls), "teacher_cls": per_sample(teacher_cls),
                "student_patch": per_sample(student_patch),
                "teacher_patch": per_sample(teacher_patch), "masks": masks,
                "patch_tokens": per_sample(tokens[:, prefix:]),
                "global_features": per_sample(tokens[:, 0]), "features": tokens[:batch, 0]}

    def loss_from_outputs(self, outputs: dict[str, Any]) -> Tensor:
        epoch = self.current_epoch
        cls_loss = self.criterion(outputs["student_cls"].unbind(1),
                                  outputs["teacher_cls"].unbind(1),
                                  self.teacher_temperature(epoch))
        patch_loss = self.patch_criterion(outputs["student_patch"], outputs["teacher_patch"],
                                          outputs["masks"], self.patch_teacher_temperature(epoch))
        self.log_terms(cls_loss=cls_loss, patch_loss=patch_loss,
                       mask_ratio=outputs["masks"].float().mean(),
                       teacher_temperature=self.teacher_temperature(epoch))
        return cls_loss + self.hparams["patch_loss_weight"] * patch_loss

    def log_terms(self, **terms: Tensor | float) -> None:
        """Log ``train/<name>`` epoch means (when a trainer is attached)."""
        if self._trainer is not None:
            for key, value in terms.items():
                self.log(f"train/{key}", value, on_step=False, on_epoch=True)

    def adjust_gradients_(self, epoch: int) -> None:
        super().adjust_gradients_(epoch)
        if self.patch_head is not None and epoch < self.hparams["freeze_last_layer_epochs"]:
            for p in self.patch_head.last_layer_parameters():
                p.grad = None

    def on_fit_start(self) -> None:
        """Fail before the first step when the data module's crops do not match."""
        super().on_fit_start()
        expected = self.hparams["num_local_crops"]
        transform = getattr(getattr(self.trainer, "datamodule", None), "train_transform", None)
        actual = getattr(transform, "num_local_crops", None)
        if expected is not None and actual is not None and actual != expected:
            raise ValueError(f"{type(self).__name__} expects num_local_crops={expected} but the "
                             f"data's train_transform makes {actual}; set them equal.")


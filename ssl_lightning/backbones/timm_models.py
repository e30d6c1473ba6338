"""Any timm model as a backbone (``pip install ssl_lightning[timm]``).

``timm.create_model(name, num_classes=0)`` removes the classifier, so the output is the pooled
(B, num_features) representation; keyword arguments such as ``img_size=32`` or
``drop_path_rate`` go to timm. A model that accepts ``dynamic_img_size`` (the ViT family) gets
``dynamic_img_size=True`` unless it is given, so multi-crop methods (global and local crops of
other sizes) run on it; a model of one fixed input size refuses another size with that advice.
Weights start random, or from a local file (``pretrained_path``); nothing is downloaded.
timm's ``DropPath`` modules (stochastic depth, ``drop_path_rate``) are replaced by ours
(:class:`~ssl_lightning.backbones.vit.DropPath`, same probability and scaling, no parameters),
which draw each sample's keep decisions from its key in training
(:mod:`ssl_lightning.training.sample_rng`); a model calling timm's functional ``drop_path``
itself, or a ``DropPath`` with ``scale_by_keep=False``, keeps torch's generator.

Dense features (:mod:`ssl_lightning.backbones.dense`) come from timm's own
``forward_features`` (a CNN's last map, a ViT's tokens put on their patch grid) and
``forward_head``.
"""

from __future__ import annotations

import difflib
from typing import Any

from torch import Tensor, nn

from ssl_lightning.backbones.dense import tokens_to_map
from ssl_lightning.backbones.pretrained import load_pretrained
from ssl_lightning.backbones.spec import remember_init_args
from ssl_lightning.backbones.vit import DropPath


def _import_timm() -> Any:
    try:
        import timm
    except ImportError as err:
        raise ImportError(
            "TimmBackbone needs timm: `pip install \"ssl_lightning[timm]\"` or `pip install timm`."
        ) from err
    return timm


class ImageSizeError(ValueError):
    """An image of another size than a fixed-size timm model takes."""


class TimmBackbone(nn.Module):
    """A ``timm`` model without its classifier, returning (B, num_features) features.

    Args:
        name: A ``timm.list_models()`` name, e.g. ``"resnet18"``, ``"vit_tiny_patch16_224"``,
            ``"convnext_atto"``.
        pretrained_path: A local state-dict file (timm format or our export) to start from.
        model_kwargs: Keyword arguments for ``timm.create_model`` (``{"img_size": 32}``); the
            form a config can give.
        **kwargs: The same as keyword arguments, for Python callers.
    """

    def __init__(
        self,
        name: str = "resnet18",
        pretrained_path: str | None = None,
        model_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        remember_init_args(self, locals())
        timm = _import_timm()
        if not timm.is_model(name):
            close = difflib.get_close_matches(name, timm.list_models(), n=5, cutoff=0.6)
            hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            raise ValueError(
                f"Unknown timm model {name!r}.{hint} See timm.list_models('*pattern*')."
            )
        options = {**(model_kwargs or {}), **kwargs}
        if "num_classes" in options:
            raise ValueError("TimmBackbone sets num_classes=0 itself (no classifier); remove it.")
        self.net = _create(timm, name, options)
        _keyed_drop_paths(timm, self.net)
        self.num_features: int = int(self.net.num_features)
        if pretrained_path is not None:
            load_pretrained(self.net, pretrained_path)

    def forward(self, x: Tensor) -> Tensor:
        self._check_size(x)
        return self.net(x)

    def forward_dense(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """timm's ``forward_features`` as a map (B, C, h, w) and ``forward_head`` of it (the
        features ``forward`` returns), from one pass."""
        self._check_size(x)
        features = self.net.forward_features(x)
        return self._as_map(features, x), self.net.forward_head(features)

    def forward_features(self, x: Tensor) -> Tensor:
        """timm's ``forward_features`` as a map (B, C, h, w)."""
        self._check_size(x)
        return self._as_map(self.net.forward_features(x), x)

    def _as_map(self, features: Tensor, x: Tensor) -> Tensor:
        if features.dim() == 4:  # a CNN's map; NHWC for the models that say so (Swin)
            nhwc = getattr(self.net, "output_fmt", "NCHW") == "NHWC"
            return features.permute(0, 3, 1, 2) if nhwc else features
        patch_embed = getattr(self.net, "patch_embed", None)
        if features.dim() != 3 or patch_embed is None:
            raise ValueError(
                f"TimmBackbone {self.net.default_cfg['architecture']!r}: forward_features gives "
                f"shape {tuple(features.shape)}, neither a (B, C, h, w) map nor patch tokens, so "
                "it has no dense features."
            )
        if hasattr(patch_embed, "dynamic_feat_size"):
            grid_h, grid_w = patch_embed.dynamic_feat_size(tuple(x.shape[-2:]))
        else:
            sides = zip(x.shape[-2:], patch_embed.patch_size, strict=True)
            grid_h, grid_w = (side // patch for side, patch in sides)
        prefix = int(getattr(self.net, "num_prefix_tokens", 0))
        return tokens_to_map(features[:, prefix:], grid_h, grid_w)

    def _check_size(self, x: Tensor) -> None:
        patch_embed = getattr(self.net, "patch_embed", None)
        size = getattr(patch_embed, "img_size", None)
        if getattr(patch_embed, "strict_img_size", False) and size is not None and (
                tuple(x.shape[-2:]) != tuple(size)):
            raise ImageSizeError(
                f"TimmBackbone {self.net.default_cfg['architecture']!r} takes only "
                f"{size[0]}x{size[1]} images, got {x.shape[-2]}x{x.shape[-1]} (multi-crop methods "
                "feed crops of several sizes). Pass model_kwargs: {dynamic_img_size: true} to a "
                "model that accepts it (timm ViTs), or give every view the model's size.")


def _keyed_drop_paths(timm: Any, net: nn.Module) -> None:
    """Replace ``net``'s timm ``DropPath`` modules by ours (per-sample keyed draws)."""
    for name, module in list(net.named_modules()):
        if isinstance(module, timm.layers.DropPath) and module.scale_by_keep:
            net.set_submodule(name, DropPath(module.drop_prob))


def _create(timm: Any, name: str, options: dict[str, Any]) -> Any:
    """``timm.create_model`` without a classifier, with ``dynamic_img_size=True`` for a model
    that accepts it and was not given it."""
    if "dynamic_img_size" not in options:
        try:
            return timm.create_model(name, pretrained=False, num_classes=0,
                                     dynamic_img_size=True, **options)
        except TypeError as err:  # the model's constructor has no such argument
            if "'dynamic_img_size'" not in str(err):
                raise
    return timm.create_model(name, pretrained=False, num_classes=0, **options)

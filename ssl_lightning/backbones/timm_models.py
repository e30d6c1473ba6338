"""Any timm model as a backbone (``pip install ssl_lightning[timm]``).

``timm.create_model(name, num_classes=0)`` removes the classifier, so the output is the pooled
(B, num_features) representation; keyword arguments such as ``img_size=32`` or
``drop_path_rate`` go to timm. Weights start random, or from a local file (``pretrained_path``);
nothing is downloaded.
"""

from __future__ import annotations

import difflib
from typing import Any

from torch import Tensor, nn

from ssl_lightning.backbones.pretrained import load_pretrained
from ssl_lightning.backbones.spec import remember_init_args


def _import_timm() -> Any:
    try:
        import timm
    except ImportError as err:
        raise ImportError(
            "TimmBackbone needs timm: `pip install \"ssl_lightning[timm]\"` or `pip install timm`."
        ) from err
    return timm


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
        self.net = timm.create_model(name, pretrained=False, num_classes=0, **options)
        self.num_features: int = int(self.net.num_features)
        if pretrained_path is not None:
            load_pretrained(self.net, pretrained_path)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

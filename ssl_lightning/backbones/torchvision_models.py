"""Any torchvision classification model as a backbone, by name, without its classifier.

Its dense features (:mod:`ssl_lightning.backbones.dense`) come from
``torchvision.models.feature_extraction``: the input of the model's ``avgpool`` and its output.
"""

from __future__ import annotations

import torchvision
from torch import Tensor, nn
from torchvision.models.feature_extraction import create_feature_extractor, get_graph_node_names

from ssl_lightning.backbones.channels import set_input_channels
from ssl_lightning.backbones.pretrained import load_pretrained
from ssl_lightning.backbones.spec import remember_init_args


class TorchvisionBackbone(nn.Module):
    """Any torchvision classification model, by name, with its final classifier Linear removed.

    The last ``nn.Linear`` of the model's ``fc`` / ``classifier`` / ``heads`` / ``head`` is replaced
    by ``nn.Identity``, so the output is the penultimate features (ResNet-50: 2048, ConvNeXt-T:
    768, MobileNetV3-S: 1024, ...). Weights start random (SSL pre-training from scratch).

    Args:
        name: A ``torchvision.models.get_model`` name, e.g. ``"resnet50"``, ``"convnext_tiny"``.
        cifar_stem: For models with ``conv1`` and ``maxpool`` (ResNet family): 3×3/stride-1 first
            convolution and no max-pool, for 32 px images.
        pretrained_path: A local state-dict file to start from (the torchvision model's own
            keys, or our export); see :mod:`ssl_lightning.backbones.pretrained`.
        in_chans: Channels of the input images; the model's first convolution is rebuilt to
            read them (:func:`~ssl_lightning.backbones.channels.set_input_channels`).
    """

    def __init__(
        self, name: str = "resnet18", cifar_stem: bool = False,
        pretrained_path: str | None = None, in_chans: int = 3,
    ) -> None:
        super().__init__()
        remember_init_args(self, locals())
        if name not in torchvision.models.list_models(module=torchvision.models):
            raise ValueError(
                f"Unknown torchvision classification model {name!r}; see "
                "torchvision.models.list_models(module=torchvision.models)."
            )
        self.model_name = name
        net = torchvision.models.get_model(name, weights=None)
        _drop_classifier(net, name)
        if cifar_stem:
            conv1 = getattr(net, "conv1", None)
            if not isinstance(conv1, nn.Conv2d) or not hasattr(net, "maxpool"):
                raise ValueError(
                    f"cifar_stem needs a model with conv1 and maxpool; {name} has none."
                )
            net.conv1 = nn.Conv2d(3, conv1.out_channels, 3, stride=1, padding=1, bias=False)
            net.maxpool = nn.Identity()
        set_input_channels(net, in_chans)
        self.net = net
        if pretrained_path is not None:
            load_pretrained(self.net, pretrained_path)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def forward_dense(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """The map entering the model's ``avgpool`` (B, C, h, w) and the pooled features
        ``forward`` returns, from one pass of a ``create_feature_extractor`` graph (built at the
        first call; it shares this module's weights and is not part of its state dict)."""
        extractor = self.__dict__.get("_dense_extractor")
        if extractor is None:
            extractor = _dense_extractor(self.net, self.model_name)
            object.__setattr__(self, "_dense_extractor", extractor)  # not a submodule
        extractor.train(self.training)
        out = extractor(x)
        return out["map"], out["pooled"]

    def forward_features(self, x: Tensor) -> Tensor:
        """The feature map entering ``avgpool`` (B, C, h, w)."""
        return self.forward_dense(x)[0]


def _drop_classifier(net: nn.Module, name: str) -> None:
    """Replace the last Linear of the model's classifier attribute with Identity, in place."""
    for attribute in ("fc", "classifier", "heads", "head"):
        head = getattr(net, attribute, None)
        if isinstance(head, nn.Linear):
            setattr(net, attribute, nn.Identity())
            return
        if isinstance(head, nn.Sequential):
            linear_names = [n for n, m in head.named_children() if isinstance(m, nn.Linear)]
            if linear_names:
                setattr(head, linear_names[-1], nn.Identity())
                return
    raise ValueError(
        f"Cannot find the classifier of torchvision model {name!r} (looked for a Linear in fc, "
        "classifier, heads, head); wrap the model yourself so it returns (B, D) features."
    )


def _dense_extractor(net: nn.Module, name: str) -> nn.Module:
    """A feature extractor of ``net`` returning ``{"map": avgpool's input, "pooled": output}``."""
    nodes = get_graph_node_names(net)[1]
    if "avgpool" not in nodes:
        raise ValueError(
            f"torchvision model {name!r} has no avgpool, so it has no spatial feature map for "
            "dense features (e.g. the ViTs); use ssl_lightning.ViT or a CNN."
        )
    before_pool = nodes[nodes.index("avgpool") - 1]
    return create_feature_extractor(net, {before_pool: "map", nodes[-1]: "pooled"})

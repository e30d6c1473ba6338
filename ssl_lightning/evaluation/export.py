"""Export the backbone of a checkpoint as a plain ``state_dict`` file.

``python -m ssl_lightning.evaluation.export --checkpoint runs/simclr/last.ckpt --output r18.pt``

- ``--format torchvision`` (default): keys of :class:`ssl_lightning.backbones.ResNet` without the
  ``backbone.net.`` prefix, loadable by ``torchvision.models.resnet18/34/50`` after
  ``model.fc = nn.Identity()`` (with the CIFAR stem also ``conv1 = Conv2d(3, 64, 3, 1, 1,
  bias=False)`` and ``maxpool = Identity()``; the command prints the exact lines).
- ``--format backbone``: keys without the ``backbone.`` prefix, loadable by the configured
  backbone class (``ResNet(...)``, ``SmallConvNet(...)``, any module).
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Mapping
from typing import Literal

import torch
from torch import Tensor

from ssl_lightning.evaluation.checkpoint import DEFAULT_PREFIX, backbone_state_dict

ExportFormat = Literal["torchvision", "backbone"]
_RESNET_DEPTHS: dict[tuple[bool, tuple[int, ...]], int] = {
    (False, (2, 2, 2, 2)): 18,
    (False, (3, 4, 6, 3)): 34,
    (True, (3, 4, 6, 3)): 50,
    (True, (3, 4, 23, 3)): 101,
    (True, (3, 8, 36, 3)): 152,
}


def torchvision_resnet_recipe(state: Mapping[str, Tensor]) -> str:
    """Python lines that build the torchvision ResNet a torchvision-format ``state`` loads into.

    Raises:
        ValueError: ``state`` is not a torchvision ResNet trunk of a known depth.
    """
    blocks = tuple(
        len({int(m.group(1)) for k in state if (m := re.match(rf"layer{i}\.(\d+)\.", k))})
        for i in range(1, 5)
    )
    bottleneck = "layer1.0.conv3.weight" in state
    depth = _RESNET_DEPTHS.get((bottleneck, blocks))
    if "conv1.weight" not in state or depth is None:
        raise ValueError(
            f"Not a torchvision ResNet trunk (blocks per stage {blocks}, bottleneck={bottleneck});"
            " export it with --format backbone and load it into the configured backbone class."
        )
    lines = ["import torch, torchvision", "from torch import nn"]
    norm = "" if "bn1.running_mean" in state else "norm_layer=lambda c: nn.GroupNorm(32, c)"
    lines.append(f"model = torchvision.models.resnet{depth}({norm})")
    if state["conv1.weight"].shape[-1] == 3:
        lines.append("model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, "
                     "bias=False)  # CIFAR stem")
        lines.append("model.maxpool = nn.Identity()")
    lines.append("model.fc = nn.Identity()  # outputs pooled features")
    return "\n".join(lines)


def export_backbone(
    checkpoint: str | os.PathLike,
    output: str | os.PathLike,
    fmt: ExportFormat = "torchvision",
    prefix: str = DEFAULT_PREFIX,
) -> dict[str, Tensor]:
    """Write the backbone weights of ``checkpoint`` to ``output`` with ``torch.save``.

    Args:
        checkpoint: A pre-training checkpoint of any ssl_lightning method.
        output: Path of the state-dict file.
        fmt: ``"torchvision"`` (strip ``net.`` too; ResNet backbones) or ``"backbone"``.
        prefix: Prefix of the backbone in the checkpoint's state dict.

    Returns:
        The exported state dict.
    """
    state = backbone_state_dict(checkpoint, prefix)
    if fmt == "torchvision":
        if not all(k.startswith("net.") for k in state):
            raise ValueError(
                "--format torchvision needs an ssl_lightning ResNet backbone (keys 'net.*'); "
                f"this one has {sorted(state)[:3]}... Use --format backbone."
            )
        state = {k[len("net."):]: v for k, v in state.items()}
        torchvision_resnet_recipe(state)
    elif fmt != "backbone":
        raise ValueError(f"Unknown export format {fmt!r}; choose 'torchvision' or 'backbone'.")
    state = {k: v.detach().clone().contiguous() for k, v in state.items()}
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    torch.save(state, output)
    return state


def main(args: list[str] | None = None) -> dict[str, Tensor]:
    """Command line: export and print how to load the file."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="pre-training .ckpt file")
    parser.add_argument("--output", required=True, help="state-dict file to write")
    parser.add_argument("--format", default="torchvision", choices=["torchvision", "backbone"])
    parser.add_argument("--prefix", default=DEFAULT_PREFIX, help="backbone prefix in the ckpt")
    ns = parser.parse_args(args)
    state = export_backbone(ns.checkpoint, ns.output, ns.format, ns.prefix)
    print(f"Wrote {len(state)} tensors to {ns.output}. Load it with:")
    if ns.format == "torchvision":
        print(torchvision_resnet_recipe(state))
    else:
        print("backbone = <the backbone class and arguments of the pre-training config>")
    print(f'model.load_state_dict(torch.load("{ns.output}"))' if ns.format == "torchvision"
          else f'backbone.load_state_dict(torch.load("{ns.output}"))')
    return state


if __name__ == "__main__":
    main()

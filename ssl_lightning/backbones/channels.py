"""Backbones for images of any channel count (``in_chans``): the first convolution rebuilt."""

from __future__ import annotations

from torch import nn


def check_in_chans(in_chans: int) -> None:
    """Raise ``ValueError`` unless ``in_chans`` is a positive channel count."""
    if in_chans < 1:
        raise ValueError(f"in_chans must be >= 1 (the images' channel count), got {in_chans}.")


def set_input_channels(net: nn.Module, in_chans: int) -> None:
    """Replace ``net``'s first ``nn.Conv2d`` (in module order) by one reading ``in_chans``
    channels, with the same output channels, kernel, stride, padding, dilation, groups and bias
    and fresh weights (pre-training from scratch). No-op for ``in_chans == 3``.

    Raises:
        ValueError: ``net`` has no ``nn.Conv2d`` reading 3 channels.
    """
    check_in_chans(in_chans)
    if in_chans == 3:
        return
    for parent in net.modules():
        for name, child in parent.named_children():
            if isinstance(child, nn.Conv2d) and child.in_channels == 3 and child.groups == 1:
                setattr(parent, name, nn.Conv2d(
                    in_chans, child.out_channels, child.kernel_size,  # type: ignore[arg-type]
                    stride=child.stride, padding=child.padding,  # type: ignore[arg-type]
                    dilation=child.dilation, bias=child.bias is not None,  # type: ignore[arg-type]
                    padding_mode=child.padding_mode))
                return
    raise ValueError(f"{type(net).__name__} has no 3-channel nn.Conv2d to read {in_chans} "
                     "channels with.")

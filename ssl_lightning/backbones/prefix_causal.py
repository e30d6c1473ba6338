"""AIM's prefix-causal attention mask (El-Nouby et al., "Scalable Pre-training of Large
Autoregressive Image Models", ICML 2024, §3): the first patches of an image (its prefix) attend
to each other bidirectionally, every later patch attends causally (to the prefix and to the
patches before it, in raster order). The [CLS] and register tokens of our ViT sit in front and
belong to the prefix, so no token ever sees a patch after the prefix that comes later than itself.
"""

from __future__ import annotations

import torch
from torch import Tensor


def prefix_causal_mask(prefix: Tensor, num_prefix_tokens: int, num_patches: int) -> Tensor:
    """(B, 1, T, T) bool attention mask, True where query ``i`` may attend key ``j``
    (T = ``num_prefix_tokens + num_patches``): ``j <= i``, or ``j`` among the
    ``num_prefix_tokens + prefix[b]`` first tokens of sample ``b``.

    Args:
        prefix: (B,) int64 prefix lengths in patches, each in [0, num_patches].
        num_prefix_tokens: [CLS] and register tokens in front of the patches.
        num_patches: Patch tokens after them.

    Raises:
        ValueError: ``prefix`` is not (B,) int64 or a length is outside [0, num_patches].
    """
    if prefix.dim() != 1 or prefix.dtype != torch.int64:
        raise ValueError(f"causal_prefix must be (B,) int64 prefix lengths, got {prefix.dtype} "
                         f"of shape {tuple(prefix.shape)}.")
    if prefix.numel() and not 0 <= int(prefix.min()) <= int(prefix.max()) <= num_patches:
        raise ValueError(f"causal_prefix lengths must be in [0, {num_patches}] (the patches of "
                         f"the image), got {prefix.tolist()}.")
    position = torch.arange(num_prefix_tokens + num_patches, device=prefix.device)
    causal = position.view(-1, 1) >= position.view(1, -1)
    in_prefix = position.view(1, -1) < (num_prefix_tokens + prefix).view(-1, 1)
    return (causal.unsqueeze(0) | in_prefix.unsqueeze(1)).unsqueeze(1)

"""AIM's prefix-causal attention option of the ViT (``forward_tokens(x, causal_prefix=S)``):

- the mask equals the definition written as loops (query i sees key j iff j <= i or j is in
  the [CLS] / register / first-S-patch prefix);
- a block's attention under it equals a hand-written float64 masked softmax
  ``softmax(QKᵀ/√d + log mask) V``;
- end to end, a patch after the prefix changes no output before it (known-bad: the
  bidirectional ViT does), a prefix of every patch is the default bidirectional ViT, and the
  option adds no parameters (checkpoints unchanged);
- bad input (prefix outside [0, K], a float tensor, combined with ``keep``) is refused.
"""

from __future__ import annotations

import math

import pytest
import torch

from ssl_lightning.backbones import ViT
from ssl_lightning.backbones.prefix_causal import prefix_causal_mask


def _vit(**kwargs) -> ViT:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    return ViT(image_size=8, patch_size=2, embed_dim=16, depth=2, num_heads=2, **kwargs).double()


def test_mask_equals_its_definition() -> None:
    prefix, heads, patches = torch.tensor([0, 1, 3, 4]), 2, 4
    mask = prefix_causal_mask(prefix, heads, patches)
    assert mask.shape == (4, 1, 6, 6) and mask.dtype == torch.bool
    for b, s in enumerate(prefix.tolist()):
        for i in range(heads + patches):
            for j in range(heads + patches):
                assert bool(mask[b, 0, i, j]) == (j <= i or j < heads + s), (b, i, j)


def test_block_attention_equals_a_hand_written_masked_softmax() -> None:
    vit = _vit(num_registers=1)
    block, x = vit.blocks[0], torch.randn(3, 2 + 16, 16, dtype=torch.float64)
    prefix = torch.tensor([1, 7, 15])
    mask = prefix_causal_mask(prefix, 2, 16)
    out = block.attention(x, attn_mask=mask)
    q, k, v = block.qkv(x).view(3, 18, 3, 2, 8).unbind(2)  # (B, T, heads, d)
    expected = torch.zeros(3, 18, 2, 8, dtype=torch.float64)
    for b in range(3):
        for h in range(2):
            scores = q[b, :, h] @ k[b, :, h].T / math.sqrt(8)
            scores = scores.masked_fill(~mask[b, 0], float("-inf"))
            expected[b, :, h] = torch.softmax(scores, dim=-1) @ v[b, :, h]
    reference = block.proj(expected.reshape(3, 18, 16))
    torch.testing.assert_close(out, reference, atol=1e-12, rtol=0)
    # known-bad: the same attention without the mask (AIM would see the future)
    assert (block.attention(x) - reference).abs().max() > 1e-3


def test_no_output_before_a_patch_depends_on_it() -> None:
    vit, x = _vit(), torch.randn(2, 3, 8, 8, dtype=torch.float64)
    changed = x.clone()
    changed[:, :, 4:6, 2:4] += 1.0  # patch 9 of the 4 x 4 grid (row 2, column 1)
    prefix = torch.tensor([3, 5])
    before = vit.forward_tokens(x, causal_prefix=prefix)
    after = vit.forward_tokens(changed, causal_prefix=prefix)
    positions = 1 + 9  # the [CLS] token, then patches 0..8 come before patch 9
    torch.testing.assert_close(after[:, :positions], before[:, :positions], atol=1e-13, rtol=0)
    assert (after[:, positions:] - before[:, positions:]).abs().max() > 1e-3
    bidirectional = vit.forward_tokens(x), vit.forward_tokens(changed)  # known-bad
    assert (bidirectional[1][:, :positions] - bidirectional[0][:, :positions]).abs().max() > 1e-3


def test_a_prefix_of_every_patch_is_the_default_bidirectional_vit() -> None:
    vit, x = _vit(num_registers=2), torch.randn(2, 3, 8, 8, dtype=torch.float64)
    full = vit.forward_tokens(x, causal_prefix=torch.tensor([16, 16]))
    torch.testing.assert_close(full, vit.forward_tokens(x), atol=1e-13, rtol=0)
    assert set(_vit().state_dict()) == set(ViT(image_size=8, patch_size=2, embed_dim=16, depth=2,
                                               num_heads=2).state_dict())


@pytest.mark.parametrize("prefix, message", [
    (torch.tensor([0, 17]), r"in \[0, 16\]"), (torch.tensor([-1, 2]), r"in \[0, 16\]"),
    (torch.tensor([1.0, 2.0]), "int64"), (torch.tensor([[1, 2]]), r"\(B,\) int64")])
def test_bad_prefix_is_refused(prefix: torch.Tensor, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _vit().forward_tokens(torch.randn(2, 3, 8, 8, dtype=torch.float64), causal_prefix=prefix)


def test_prefix_with_a_subset_of_patches_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot be combined with keep"):
        _vit().forward_tokens(torch.randn(2, 3, 8, 8, dtype=torch.float64),
                              keep=torch.tensor([[0, 1], [2, 3]]),
                              causal_prefix=torch.tensor([1, 1]))

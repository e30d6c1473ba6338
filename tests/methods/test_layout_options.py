"""Layout options of :class:`SSLMethod`: ``channels_last`` and ``compile_backbone``.

(Mixed precision is a property of every registered method: ``tests/properties/test_autocast.py``.)
"""

from __future__ import annotations

import torch
from torch import Tensor

from ssl_lightning.backbones import SmallConvNet
from ssl_lightning.methods import SimCLR


def _simclr(**kwargs: bool) -> SimCLR:
    torch.manual_seed(0)
    return SimCLR(SmallConvNet((8, 16)), projection_hidden_dim=16, projection_dim=8,
                  head_batch_norm=False, optimizer="sgd", **kwargs)


def test_channels_last_option_changes_layout_not_results():
    plain, fast = _simclr(), _simclr(channels_last=True)
    fast.setup("fit")
    conv = fast.backbone.net[0].weight
    assert conv.is_contiguous(memory_format=torch.channels_last) and not conv.is_contiguous()
    seen: list[Tensor] = []
    fast.backbone.net[0].register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    views = [torch.randn(4, 3, 16, 16), torch.randn(4, 3, 16, 16)]
    loss_plain, feats_plain = plain.training_loss(views)
    loss_fast, feats_fast = fast.training_loss(views)
    assert seen[0].is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(loss_fast, loss_plain, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(feats_fast, feats_plain, atol=1e-6, rtol=1e-6)
    assert plain.state_dict().keys() == fast.state_dict().keys()


def test_compile_backbone_option_compiles_in_place_keeping_checkpoint_keys():
    plain, compiled = _simclr(), _simclr(compile_backbone=True)
    compiled.setup("fit")
    compiled.setup("fit")  # idempotent
    assert compiled.backbone._compiled_call_impl is not None
    assert plain.backbone._compiled_call_impl is None
    assert plain.state_dict().keys() == compiled.state_dict().keys()

"""Mixed precision and layout.

Every loss class in ``ssl_lightning.losses`` runs under ``autocast(bfloat16)`` and
``autocast(float16)`` on CPU. The stated tolerance: given the same (rounded) inputs, the loss
under autocast equals the fp32 loss to 1e-5 relative (so it really computes in fp32 inside: a
bf16 softmax/matmul is off by ~1e-2), and it stays within 3e-2 relative of the loss on the
unrounded fp32 inputs. Also: the
``channels_last`` and ``compile_backbone`` options of :class:`SSLMethod`.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

import ssl_lightning.losses as losses
from ssl_lightning.backbones import SmallConvNet
from ssl_lightning.methods import SimCLR

B, D, K = 8, 16, 12


def _randn(*shape: int) -> Tensor:
    return torch.randn(*shape)


def _directions() -> Tensor:
    return torch.nn.functional.normalize(torch.randn(D, K), dim=0)


# One factory per loss class: (loss module, positional inputs (tensors or lists of tensors)).
LOSS_CASES: dict[str, Callable[[], tuple[nn.Module, tuple]]] = {
    "NTXentLoss": lambda: (losses.NTXentLoss(0.2, chunk_size=None), (_randn(B, D), _randn(B, D))),
    "NTXentLoss(chunked)": lambda: (losses.NTXentLoss(0.2, chunk_size=5),
                                    (_randn(B, D), _randn(B, D))),
    "InfoNCELoss": lambda: (losses.InfoNCELoss(0.2), (_randn(B, D), _randn(B, D), _randn(K, D))),
    "MoCoV3Loss": lambda: (losses.MoCoV3Loss(0.2), (_randn(B, D), _randn(2 * B, D), B)),
    "BYOLLoss": lambda: (losses.BYOLLoss(), tuple(_randn(B, D) for _ in range(4))),
    "NegativeCosineLoss": lambda: (losses.NegativeCosineLoss(),
                                   tuple(_randn(B, D) for _ in range(4))),
    "BarlowTwinsLoss": lambda: (losses.BarlowTwinsLoss(), (_randn(B, D), _randn(B, D))),
    "VICRegLoss": lambda: (losses.VICRegLoss(), (_randn(B, D), _randn(B, D))),
    "DINOLoss": lambda: (losses.DINOLoss(K), ([_randn(B, K) for _ in range(3)],
                                             [_randn(B, K) for _ in range(2)], 0.04)),
    "SwAVLoss": lambda: (losses.SwAVLoss(), ([torch.nn.functional.normalize(_randn(B, K), dim=1)
                                              for _ in range(3)],)),
    "MAELoss": lambda: (losses.MAELoss(), (_randn(B, 4, 12), _randn(B, 4, 12))),
    "IJEPALoss": lambda: (losses.IJEPALoss(), (_randn(B, 2, 3, D), _randn(B, 2, 3, D))),
    "SimMIMLoss": lambda: (losses.SimMIMLoss(), (_randn(B, 4, 12), _randn(B, 4, 12))),
    "AIMLoss": lambda: (losses.AIMLoss(), (_randn(B, 4, 12), _randn(B, 5, 12),
                                           torch.arange(B) % 4 + 1)),
    "DCLLoss": lambda: (losses.DCLLoss(0.2, chunk_size=None), (_randn(B, D), _randn(B, D))),
    "DCLLoss(weighted, chunked)": lambda: (losses.DCLLoss(0.2, weight_sigma=0.5, chunk_size=5),
                                           (_randn(B, D), _randn(B, D))),
    "NNCLRLoss": lambda: (losses.NNCLRLoss(0.2, chunk_size=None), (_randn(B, D), _randn(B, D))),
    "SupConLoss": lambda: (losses.SupConLoss(0.2, chunk_size=5),
                           (_randn(B, D), _randn(B, D), torch.arange(B) % 3)),
    "IBOTPatchLoss": lambda: (losses.IBOTPatchLoss(K), (_randn(B, 2, 4, K), _randn(B, 2, 4, K),
                                                        torch.arange(B * 2 * 4).view(B, 2, 4) % 3
                                                        == 0, 0.04)),
    "KoLeoLoss": lambda: (losses.KoLeoLoss(), (_randn(B, D),)),
    "FastSiamLoss": lambda: (losses.FastSiamLoss(), ([_randn(B, D) for _ in range(3)],
                                                     [_randn(B, D) for _ in range(3)])),
    "IBOTPatchLoss(iBOT++)": lambda: (losses.IBOTPatchLoss(K, visible_weight=1.0),
                                      (_randn(B, 2, 4, K), _randn(B, 2, 4, K),
                                       torch.arange(B * 2 * 4).view(B, 2, 4) % 3 == 0, 0.04)),
    "SIGRegLoss": lambda: (losses.SIGRegLoss(num_slices=K), (_randn(B, 3, D), _directions())),
    "LeJEPALoss": lambda: (losses.LeJEPALoss(num_slices=K), (_randn(B, 4, D), _directions())),
    "TiCoLoss": lambda: (losses.TiCoLoss(D), (_randn(B, D), _randn(B, D))),
    "MMCRLoss": lambda: (losses.MMCRLoss(0.1), (_randn(B, 3, D),)),
    "WMSELoss": lambda: (losses.WMSELoss(whitening_size=4), (_randn(B, 2, 3),
                                                            (torch.randperm(B),))),
    "VIbCRegLoss": lambda: (losses.VIbCRegLoss(), (_randn(B, D), _randn(B, D))),
    "GramLoss": lambda: (losses.GramLoss(), (_randn(B, 4, D), _randn(B, 4, D))),
    "QueueDistillationLoss": lambda: (losses.QueueDistillationLoss(),
                                      (_randn(B, D), _randn(B, D), _randn(K, D))),
    "PatchSimilarityDistillationLoss": lambda: (losses.PatchSimilarityDistillationLoss(),
                                                (_randn(B, 4, D), _randn(B, 4, D))),
    "DistillationLoss": lambda: (losses.DistillationLoss(), (_randn(B, D), _randn(B, D),
                                                             _randn(K, D), _randn(B, 4, D),
                                                             _randn(B, 4, D))),
    "MSNLoss": lambda: (losses.MSNLoss(), (_randn(B, 3, D), _randn(B, D), _randn(K, D))),
    "MSNLoss(PMSN)": lambda: (losses.MSNLoss(power_law_exponent=0.25),
                              (_randn(B, 3, D), _randn(B, D), _randn(K, D))),
    "ReSSLLoss": lambda: (losses.ReSSLLoss(), (_randn(B, D), _randn(B, D), _randn(K, D))),
    "FeatureRedundancyLoss": lambda: (losses.FeatureRedundancyLoss(),
                                      tuple(_randn(B, D) for _ in range(4))),
    "All4OneLoss": lambda: (losses.All4OneLoss(chunk_size=3),
                            tuple([_randn(B, D), _randn(B, D)] for _ in range(6))),
    "DeepClusterLoss": lambda: (losses.DeepClusterLoss(),
                                ([_randn(B, 3, K), _randn(B, 3, K - 2)],
                                 torch.stack([torch.randint(K, (B,)),
                                              torch.randint(K - 2, (B,))]))),
}


def _map(inputs: tuple, fn: Callable[[Tensor], Tensor]) -> tuple:
    """``fn`` on the floating-point tensors of ``inputs`` (labels and masks stay as they are)."""
    def floating(t: object) -> bool:
        return isinstance(t, Tensor) and t.is_floating_point()

    return tuple([fn(t) for t in x] if isinstance(x, list) else fn(x) if floating(x)
                 else x for x in inputs)


def _leaves(inputs: tuple) -> list[Tensor]:
    return [t for x in inputs for t in (x if isinstance(x, list) else [x])
            if isinstance(t, Tensor)]


def test_every_loss_class_has_an_autocast_case():
    classes = {name for name in losses.__all__
               if inspect.isclass(getattr(losses, name)) and
               issubclass(getattr(losses, name), nn.Module)}
    assert classes <= {name.split("(")[0] for name in LOSS_CASES}, classes


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", sorted(LOSS_CASES))
def test_loss_computes_in_fp32_under_autocast(name: str, dtype: torch.dtype):
    """bf16-mixed and 16-mixed: the same check with fp16 autocast (on CPU since torch 2.x)."""
    torch.manual_seed(0)
    loss_fn, inputs = LOSS_CASES[name]()
    reference_fn = copy.deepcopy(loss_fn)  # DINO's centre is updated by each call
    exact_fn = copy.deepcopy(loss_fn)
    low = _map(inputs, lambda t: t.to(dtype).requires_grad_())
    with torch.autocast("cpu", dtype=dtype):
        out = loss_fn(*low)
    assert out.dtype == torch.float32 and torch.isfinite(out)
    out.backward()
    for leaf in _leaves(low):
        if leaf.grad is not None:
            assert leaf.grad.dtype == dtype and torch.isfinite(leaf.grad).all()
    same_values = reference_fn(*_map(low, lambda t: t.detach().float()))
    torch.testing.assert_close(out, same_values, rtol=1e-5, atol=1e-6)
    unrounded = exact_fn(*inputs)
    torch.testing.assert_close(out, unrounded, rtol=3e-2, atol=1e-3)


def test_nt_xent_in_bf16_would_fail_the_tolerance():
    """The 1e-5 tolerance above bites: the same NT-Xent computed in bf16 is off by more."""
    torch.manual_seed(0)
    z1, z2 = torch.randn(B, D).bfloat16(), torch.randn(B, D).bfloat16()
    fp32 = losses.NTXentLoss(0.2, chunk_size=None)(z1.float(), z2.float())
    z = torch.nn.functional.normalize(torch.cat([z1, z2]), dim=1)
    logits = (z @ z.T / 0.2).fill_diagonal_(float("-inf"))
    target = torch.cat([torch.arange(B, 2 * B), torch.arange(B)])
    bf16 = torch.nn.functional.cross_entropy(logits, target)
    assert bf16.dtype == torch.bfloat16
    assert (bf16.float() - fp32).abs() > 1e-5 * fp32.abs()


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

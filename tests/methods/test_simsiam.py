"""SimSiam: the symmetrised negative cosine against a loop
reference, the stop-gradient, fp32 under bf16 autocast, the predictor's fixed learning rate and
exact resume."""

import math

import pytest
import pytorch_lightning as pl
import torch
from loss_references import assert_computes_in_fp32_under_bf16
from momentum_utils import cpu_trainer, views_loader

from ssl_lightning.backbones import SmallConvNet
from ssl_lightning.losses import NegativeCosineLoss
from ssl_lightning.methods import SimSiam


def simsiam_reference(p1, p2, z1, z2) -> float:
    """Chen & He 2021, Eq. (1)-(2): D(p, z) = -p.z / (|p| |z|); L = D(p1, z2)/2 + D(p2, z1)/2,
    averaged over the batch."""
    def d(p, z):
        dot = sum(a * b for a, b in zip(p, z, strict=True))
        return -dot / (math.sqrt(sum(a * a for a in p)) * math.sqrt(sum(b * b for b in z)))

    n = len(p1)
    return sum(d(p1[i], z2[i]) / 2 + d(p2[i], z1[i]) / 2 for i in range(n)) / n


def _tensors(n=6, d=5):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(n, d, generator=g, dtype=torch.float64) for _ in range(4)]


def test_loss_matches_loop_reference_and_closed_forms():
    p1, p2, z1, z2 = _tensors()
    loss = NegativeCosineLoss()(p1, p2, z1, z2)
    expected = simsiam_reference(*(t.tolist() for t in (p1, p2, z1, z2)))
    assert loss.dtype == torch.float64 and abs(loss.item() - expected) < 1e-12
    # Predictions along their targets (any positive scale): the minimum, -1.
    assert NegativeCosineLoss()(3 * z2, 0.5 * z1, z1, z2).item() == pytest.approx(-1, abs=1e-12)


def test_targets_get_no_gradient():
    p1, p2, z1, z2 = (t.requires_grad_() for t in _tensors())
    NegativeCosineLoss()(p1, p2, z1, z2).backward()
    assert z1.grad is None and z2.grad is None
    assert p1.grad.abs().max() > 0 and p2.grad.abs().max() > 0


def test_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="equal shape"):
        NegativeCosineLoss()(torch.zeros(4, 3), torch.zeros(4, 3), torch.zeros(4, 3),
                             torch.zeros(4, 2))


def test_bf16_autocast_computes_in_fp32():
    assert_computes_in_fp32_under_bf16(NegativeCosineLoss(), num_inputs=4, rtol=0, atol=1e-2)


def _model(fixed_predictor_lr: bool = True) -> SimSiam:
    return SimSiam(SmallConvNet(widths=(8, 16), norm="group"), projection_hidden_dim=16,
                   projection_dim=16, projection_layers=2, predictor_hidden_dim=8,
                   fixed_predictor_lr=fixed_predictor_lr, optimizer="sgd", lr=0.5,
                   weight_decay=5e-4, warmup_epochs=1)


class _RecordLRs(pl.Callback):
    def __init__(self) -> None:
        self.lrs: list[list[float]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.lrs.append([g["lr"] for g in trainer.optimizers[0].param_groups])


@pytest.mark.parametrize("fixed", [True, False])
def test_predictor_learning_rate_is_fixed_only_when_asked(tmp_path, fixed):
    record = _RecordLRs()
    model = _model(fixed)
    cpu_trainer(str(tmp_path), 2, callbacks=[record], enable_checkpointing=False).fit(
        model, views_loader(8, 4, size=8))
    groups = model.trainer.optimizers[0].param_groups
    predictor = {id(p) for p in model.predictor.parameters()}
    in_predictor = [all(id(p) in predictor for p in g["params"]) for g in groups]
    assert sum(in_predictor) == (2 if fixed else 0)
    peak = 0.5 * 4 / 256  # linear scaling rule, batch 4
    lrs = torch.tensor(record.lrs)  # (4 steps, groups): warm-up 2 steps then cosine
    for column, is_predictor in zip(lrs.T, in_predictor, strict=True):
        expected = [peak] * 4 if is_predictor else [peak / 2, peak, peak, peak / 2]
        torch.testing.assert_close(column, torch.tensor(expected, dtype=column.dtype))

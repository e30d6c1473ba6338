"""SwAV method: prototypes (unit norm, frozen first N steps), one backbone call per resolution,
queue start/fill, and exact resume (queue, prototypes, schedules)."""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from momentum_utils import cpu_trainer, fit_and_resume, state_of
from multicrop_utils import CountingModule, multicrop_loader

from ssl_lightning.backbones import SmallConvNet
from ssl_lightning.heads import SwAVPrototypes
from ssl_lightning.methods import SwAV


def make_swav(**kwargs) -> SwAV:
    args = dict(projection_hidden_dim=16, projection_dim=8, num_prototypes=10,
                freeze_prototypes_steps=3, optimizer="lars", lr=0.5, lr_scaling="none",
                warmup_epochs=0, queue_size=8, queue_start_epoch=1)
    args.update(kwargs)
    return SwAV(SmallConvNet((8, 16), norm="group"), **args)


def test_prototypes_normalise_in_place_and_score():
    torch.manual_seed(0)
    protos = SwAVPrototypes(4, 6)
    with torch.no_grad():
        protos.weight.mul_(3.0)
    protos.normalize_()
    torch.testing.assert_close(protos.weight.norm(dim=1), torch.ones(6))
    z = F.normalize(torch.randn(5, 4), dim=1)
    torch.testing.assert_close(protos(z), z @ protos.weight.T)
    with pytest.raises(ValueError):
        SwAVPrototypes(4, 0)


def test_one_backbone_call_per_resolution_and_codes_from_global_crops():
    torch.manual_seed(0)
    model = SwAV(CountingModule(SmallConvNet((8, 16))), projection_hidden_dim=8,
                 projection_dim=4, num_prototypes=5)
    views = [torch.randn(3, 3, s, s) for s in (16, 16, 8, 8, 8)]
    loss, features = model.training_loss(views)
    assert model.backbone.calls == [(6, 3, 16, 16), (9, 3, 8, 8)]
    assert features.shape == (3, 16) and loss.ndim == 0
    assert model.criterion.crops_for_assign == (0, 1)
    torch.testing.assert_close(model.prototypes.weight.norm(dim=1), torch.ones(5))


class RecordPrototypes(pl.Callback):
    """Prototype norms seen by the optimiser step, and the weights after every step."""

    def __init__(self) -> None:
        self.norms: list[torch.Tensor] = []
        self.weights: list[torch.Tensor] = []
        self.queue_filled: list[int] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.norms.append(pl_module.prototypes.weight.norm(dim=1).detach().clone())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.weights.append(pl_module.prototypes.weight.detach().clone())
        self.queue_filled.append(int(pl_module.queue_filled))


def test_prototypes_frozen_then_trained_and_queue_starts_at_its_epoch(tmp_path):
    torch.manual_seed(0)
    model = make_swav()
    initial = F.normalize(state_of(model)["prototypes.layer.weight"], dim=1)
    recorder = RecordPrototypes()
    cpu_trainer(str(tmp_path), 2, callbacks=[recorder], enable_checkpointing=False).fit(
        model, multicrop_loader())
    for norms in recorder.norms:  # normalised before every forward
        torch.testing.assert_close(norms, torch.ones(10))
    for weights in recorder.weights[:3]:  # frozen for freeze_prototypes_steps = 3
        torch.testing.assert_close(weights, initial, rtol=0, atol=1e-7)
    assert (recorder.weights[3] - initial).abs().max() > 1e-4
    # Epoch 0: no queue; epoch 1 (batch 4, length 8): filled after 2 steps, then used.
    assert recorder.queue_filled == [0, 0, 0, 0, 4, 8, 8, 8]


def test_queue_changes_the_loss_once_full():
    torch.manual_seed(0)
    with_queue = make_swav(queue_start_epoch=0, head_batch_norm=False)
    without = make_swav(queue_size=0, head_batch_norm=False)
    weights = {k: v for k, v in with_queue.state_dict().items() if not k.startswith("queue")}
    without.load_state_dict(weights, strict=False)
    batches = [views for views, _ in multicrop_loader()]
    with torch.no_grad():
        first = with_queue.training_loss(batches[0])[0], without.training_loss(batches[0])[0]
        assert first[0] == first[1]  # queue not full yet (4 of 8): not used
        with_queue.training_loss(batches[1])
        assert int(with_queue.queue_filled) == 8
        torch.testing.assert_close(with_queue.queue[0, :4], F.normalize(
            with_queue.projector(with_queue.backbone(batches[1][0])), dim=1))
        assert with_queue.training_loss(batches[2])[0] != without.training_loss(batches[2])[0]


def test_exact_resume_queue_prototypes_and_schedules(tmp_path):
    full, resumed = fit_and_resume(make_swav, multicrop_loader, str(tmp_path))
    assert full.keys() == resumed.keys()
    for key, value in full.items():
        assert torch.equal(resumed[key], value), key
    assert int(full["queue_filled"]) == 8 and full["queue"].abs().sum() > 0


def test_queue_size_must_divide_over_processes():
    model = make_swav(queue_size=8)
    assert model.queue_share().shape == (2, 8, 8)


@pytest.mark.parametrize(
    "kwargs",
    [dict(freeze_prototypes_steps=-1), dict(queue_size=-8), dict(queue_start_epoch=-1),
     dict(temperature=0.0), dict(sinkhorn_epsilon=0.0), dict(sinkhorn_iterations=0),
     dict(num_prototypes=0)],
)
def test_invalid_arguments(kwargs):
    with pytest.raises(ValueError):
        make_swav(**kwargs)

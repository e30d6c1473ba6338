"""Issue 2, check 3: SimCLR trained by Lightning with 2 CPU processes (ddp_spawn, gloo) ends with
the same parameters as one process trained on the doubled batch."""

import pytorch_lightning as pl
from lightning_ddp_utils import (
    PrecomputedViews,
    TensorDataModule,
    assert_states_close,
    ddp_global_order,
    fit_and_dump,
)
from torch.utils.data import Subset

from ssl_lightning.backbones import SmallConvNet
from ssl_lightning.methods import SimCLR

BATCH, STEPS, SAMPLES = 4, 3, 24


def _model() -> SimCLR:
    pl.seed_everything(0)
    return SimCLR(
        SmallConvNet(widths=(8, 16), norm="group"), projection_hidden_dim=16, projection_dim=8,
        projection_batch_norm=False, temperature=0.2, optimizer="sgd", lr=0.5,
        lr_scaling="linear", weight_decay=1e-4, warmup_epochs=0,
    )


def test_two_process_fit_equals_single_process_with_doubled_batch() -> None:
    data = PrecomputedViews(SAMPLES)
    ddp = fit_and_dump(_model(), TensorDataModule(data, BATCH), devices=2, max_steps=STEPS)
    order = ddp_global_order(SAMPLES, 2, BATCH)
    single = fit_and_dump(
        _model(), TensorDataModule(Subset(data, order), 2 * BATCH), devices=1, max_steps=STEPS
    )
    initial = _model().state_dict()
    assert ddp[0]["global_step"] == single[0]["global_step"] == STEPS
    # Training moved the weights well beyond the tolerance, so equality is not vacuous.
    moved = max((single[0]["model"][k] - initial[k]).abs().max() for k in initial)
    assert moved > 1e-3
    for rank_state in ddp:
        assert_states_close(rank_state["model"], single[0]["model"], atol=1e-6)
        assert_states_close(rank_state["optimizer"], single[0]["optimizer"], atol=1e-6)
        assert_states_close(rank_state["scheduler"], single[0]["scheduler"], atol=1e-9)

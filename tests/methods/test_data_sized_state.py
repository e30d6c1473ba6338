"""Methods whose state is sized by the training data (:attr:`SSLMethod.data_sized_state`) load a
trained state into a model built without data: what Lightning's ``ddp_spawn`` launcher does in
the main process after the fit, and a resume into a fresh model."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import pytest
import pytorch_lightning as pl
import torch

import ssl_lightning.methods as methods
from ssl_lightning.backbones import SmallConvNet
from ssl_lightning.methods import DeepClusterV2, SSLMethod
from ssl_lightning.testing.trainer_runs import KeyedViews, TensorDataModule, assert_states_close

#: A small instance of every method with data-sized state.
SMALL: dict[type, Callable[[], SSLMethod]] = {
    DeepClusterV2: lambda: DeepClusterV2(
        SmallConvNet((4, 8), norm="group"), projection_hidden_dim=8, projection_dim=4,
        head_batch_norm=False, num_prototypes=(3, 2), optimizer="sgd", lr=0.1, warmup_epochs=0),
}


def test_every_method_with_data_sized_state_is_covered() -> None:
    sized = {cls for _, cls in inspect.getmembers(methods, inspect.isclass)
             if issubclass(cls, SSLMethod) and cls.data_sized_state}
    assert sized == set(SMALL)


@pytest.mark.parametrize("method", list(SMALL), ids=lambda cls: cls.__name__)
def test_trained_state_loads_into_a_model_built_without_data(method: type) -> None:
    torch.manual_seed(0)
    trained = SMALL[method]()
    pl.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False).fit(
        trained, datamodule=TensorDataModule(KeyedViews(12), 4))
    state = trained.state_dict()
    for key in method.data_sized_state:
        assert state[key].shape[1] == 12  # one row per training sample
    fresh = SMALL[method]()
    fresh.load_state_dict(state)  # strict, as Lightning's launcher and resume load
    assert_states_close(fresh.state_dict(), state, atol=0.0)

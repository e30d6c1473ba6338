"""SupCon (Khosla et al., NeurIPS 2020) as a method: the loss needs the batch's class labels, and
a batch with an unlabelled sample (target -1) is refused, naming the count and what to do."""

from __future__ import annotations

import pytest
import torch

from ssl_lightning.methods.registry import method_entry


def _outputs() -> tuple:  # type: ignore[type-arg]
    model = method_entry("supcon").small()
    g = torch.Generator().manual_seed(0)
    return model, model.forward_views([torch.randn(4, 3, 8, 8, generator=g) for _ in range(2)])


def test_the_loss_needs_the_batch_labels() -> None:
    model, outputs = _outputs()
    with pytest.raises(ValueError, match="SupCon needs the batch's class labels"):
        model.loss_from_outputs(outputs)
    outputs["targets"] = torch.tensor([0, 1, 0, 1])
    assert torch.isfinite(model.loss_from_outputs(outputs))


def test_an_unlabelled_sample_is_refused() -> None:
    model, outputs = _outputs()
    outputs["targets"] = torch.tensor([0, 1, -1, 1])
    with pytest.raises(ValueError, match="1 of the 4 samples of the batch have target -1"):
        model.loss_from_outputs(outputs)

"""A ``pretrained_path`` whose weights hold NaN or infinite values is refused, naming the file
and its first such tensor, before the backbone is used."""

from __future__ import annotations

from pathlib import Path

import pytest
import safetensors.torch
import torch

from ssl_lightning.backbones import SmallConvNet


@pytest.mark.parametrize(("value", "suffix"), [(float("nan"), ".pt"), (float("inf"), ".pt"),
                                               (float("-inf"), ".safetensors")])
def test_non_finite_weights_are_refused_naming_the_file_and_tensor(
        tmp_path: Path, value: float, suffix: str) -> None:
    state = SmallConvNet(widths=(8, 8)).state_dict()
    state["net.3.weight"][0, 0, 0, 0] = value
    path = tmp_path / f"weights{suffix}"
    save = torch.save if suffix == ".pt" else safetensors.torch.save_file
    save(state, path)
    with pytest.raises(ValueError, match=rf"pretrained_path '{path}' holds NaN or infinite "
                                         r"values: tensor 'net.3.weight' has 1 of 576"):
        SmallConvNet(widths=(8, 8), pretrained_path=str(path))
    state["net.3.weight"][0, 0, 0, 0] = 0.0
    save(state, path)
    assert torch.equal(SmallConvNet(widths=(8, 8), pretrained_path=str(path)).state_dict()
                       ["net.3.weight"], state["net.3.weight"])


def test_loading_says_what_it_loaded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from torch import nn

    from ssl_lightning.backbones import pretrained

    logged: list[str] = []
    monkeypatch.setattr(pretrained, "rank_zero_info", logged.append)
    target = nn.Sequential(nn.Linear(3, 4))
    saved = {"module.0.weight": torch.ones(4, 3), "module.0.bias": torch.zeros(4),
             "module.fc.weight": torch.ones(10, 4), "module.fc.bias": torch.zeros(10)}
    path = tmp_path / "weights.pt"
    torch.save(saved, path)
    line = pretrained.load_pretrained(target, path)
    assert logged == [line]
    assert line == (f"pretrained_path '{path}': loaded 2 tensors (16 values) into Sequential, "
                    "the model's own layout, prefix 'module.' removed, 2 classifier tensors "
                    "ignored (fc.weight, fc.bias); 0 missing and 0 unexpected keys")
    assert torch.equal(target[0].weight, torch.ones(4, 3))

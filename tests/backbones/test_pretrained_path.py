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


def test_a_method_checkpoint_gives_its_students_backbone(tmp_path: Path) -> None:
    """A ``.ckpt`` of a method (backbone, heads and an EMA teacher) as ``pretrained_path``: the
    backbone gets the student's ``backbone.*`` weights, the heads and teacher are left out
    (a post-training method such as NeCo starts from such a file)."""
    from ssl_lightning.backbones import ViT
    from ssl_lightning.methods.registry import method_entry

    def vit(**kwargs: object) -> ViT:
        return ViT(image_size=8, patch_size=4, embed_dim=16, depth=1, num_heads=2, **kwargs)

    method = method_entry("dino").small(vit())
    with torch.no_grad():
        for parameter in method.teacher_backbone.parameters():
            parameter.add_(1.0)  # the teacher differs from the student
    path = tmp_path / "last.ckpt"
    torch.save({"state_dict": method.state_dict(), "pytorch-lightning_version": "2.5.0"}, path)
    loaded = vit(pretrained_path=str(path))
    student = method.backbone.state_dict()
    assert loaded.state_dict().keys() == student.keys()
    assert all(torch.equal(value, student[key]) for key, value in loaded.state_dict().items())

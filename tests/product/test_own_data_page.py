"""docs/own_data.md cannot rot: its example script (one's own Dataset in an ``SSLDataModule``,
SimCLR and the kNN callback) runs as written on fewer, smaller settings, and trains on seeded
batches whose kNN accuracy reaches the callback."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import ssl_lightning
from ssl_lightning.backbones import SmallConvNet

ROOT = Path(__file__).resolve().parents[2]
PAGE = (ROOT / "docs" / "own_data.md").read_text()
SCRIPT = next(block for block in re.findall(r"```python\n(.*?)```", PAGE, re.DOTALL)
              if block.startswith("# train_my_data.py"))
#: The page's sizes -> a test's (each must appear once in the script as written).
SMALLER = {
    "random_images(1024, 0), random_images(256, 1), batch_size=128":
        "random_images(16, 0), random_images(8, 1), batch_size=4",
    "num_workers=4": "num_workers=0",
    "max_epochs=2": "max_epochs=1, accelerator='cpu', enable_progress_bar=False",
}


def test_the_example_script_trains_on_seeded_batches_with_the_knn_callback(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture) -> None:
    script = SCRIPT
    for page_text, test_text in SMALLER.items():
        assert script.count(page_text) == 1, page_text
        script = script.replace(page_text, test_text)
    monkeypatch.setattr(ssl_lightning, "ResNet", lambda **kwargs: SmallConvNet(widths=(4, 8)))
    monkeypatch.chdir(tmp_path)  # Lightning's logs go to a temporary folder
    seeds: list[torch.Tensor] = []
    from ssl_lightning.methods import SimCLR

    step = SimCLR.training_step
    monkeypatch.setattr(SimCLR, "training_step",
                        lambda self, batch, i: (seeds.append(batch[2]), step(self, batch, i))[1])
    exec(compile(script, "own_data.md", "exec"), {"__name__": "__main__"})
    assert len(seeds) == 4 and all(s.dtype == torch.int64 and s.shape == (4,) for s in seeds)
    assert re.search(r"kNN top-1: \d+\.\d%\n", capsys.readouterr().out)

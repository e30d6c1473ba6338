"""DCL / DCLW (Yeh et al., ECCV 2022) as a method: it takes none of NT-Xent's options (a value
for one is refused, naming it), and checkpoints from when DCL was a SimCLR subclass (which
record those options at 0) still load."""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch

from ssl_lightning.backbones import SmallConvNet
from ssl_lightning.backbones.spec import backbone_spec
from ssl_lightning.methods import DCL


@pytest.mark.parametrize(("build", "message"), [
    (lambda: DCL(SmallConvNet((8,)), queue_size=8), "DCL has no queue_size"),
    (lambda: DCL(SmallConvNet((8,)), memory_bank_size=8), "DCL has no memory_bank_size"),
])
def test_an_nt_xent_option_is_refused_naming_it(build, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=message):
        build()


def test_a_dcl_checkpoint_from_when_dcl_was_a_simclr_subclass_loads(tmp_path) -> None:
    """Such checkpoints record SimCLR's NT-Xent options at 0 (``margin``, ``queue_size``);
    DCL no longer takes them, yet ``load_from_checkpoint`` of such a file rebuilds it."""
    model = DCL(SmallConvNet((8,)), projection_hidden_dim=8, projection_dim=4, weight_sigma=0.5)
    path = tmp_path / "old_dcl.ckpt"
    torch.save({"state_dict": model.state_dict(), "pytorch-lightning_version": pl.__version__,
                "hyper_parameters": {**model.hparams, "margin": 0.0, "queue_size": 0},
                "backbone_spec": backbone_spec(model.backbone)}, path)
    loaded = DCL.load_from_checkpoint(str(path))
    assert loaded.weight_sigma == 0.5 and "margin" not in loaded.hparams
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in loaded.state_dict().items())

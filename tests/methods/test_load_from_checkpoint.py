"""``Method.load_from_checkpoint(path)`` with no arguments, for checkpoints the CLI writes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ssl_lightning.evaluation.checkpoint import backbone_from_checkpoint
from ssl_lightning.methods import DINO, SimCLR

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("config, method", [("simclr.yaml", SimCLR), ("dino.yaml", DINO)],
                         ids=["simclr", "dino-momentum-teacher"])
def test_load_from_checkpoint_needs_no_arguments(run_config, config, method):
    cli = run_config(CONFIGS / config)
    path = str(Path(cli.trainer.default_root_dir) / "m.ckpt")
    cli.trainer.save_checkpoint(path)
    loaded = method.load_from_checkpoint(path)
    assert type(loaded) is method
    trained = cli.model.state_dict()
    assert loaded.state_dict().keys() == trained.keys()
    for key, value in loaded.state_dict().items():  # backbone, heads and teacher alike
        torch.testing.assert_close(value, trained[key], rtol=0, atol=0, msg=key)


def test_a_sharded_checkpoint_directory_loads_without_arguments(tmp_path, tiny_image_folder):
    import torch.distributed as dist

    from ssl_lightning.cli import main

    started = dist.is_initialized()
    cli = main(["fit", "--config", str(CONFIGS / "simclr.yaml"),
                "--config", str(CONFIGS / "shared" / "fsdp.yaml"),
                "--data.root", str(tiny_image_folder), "--data.batch_size", "4",
                "--data.num_workers", "0", "--trainer.accelerator", "cpu",
                "--trainer.devices", "1", "--trainer.max_steps", "1",
                "--trainer.limit_val_batches", "0", "--trainer.logger", "false",
                "--trainer.enable_progress_bar", "false",
                "--trainer.default_root_dir", str(tmp_path),
                "--model.backbone", "SmallConvNet", "--model.backbone.widths", "[8, 16]"])
    if dist.is_initialized() and not started:  # the strategy's 1-process group
        dist.destroy_process_group()
    path = tmp_path / "checkpoints" / "last.ckpt"
    assert path.is_dir()
    loaded = SimCLR.load_from_checkpoint(str(path))
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # the weights the shards hold, assembled (the reader of embed/export)
        torch.testing.assert_close(loaded.eval().backbone(x),
                                   backbone_from_checkpoint(str(path)).eval()(x), rtol=0, atol=0)
    assert cli.trainer.global_step == 1

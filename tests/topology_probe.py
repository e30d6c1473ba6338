"""A callback that records what a (multi-node) run sees of its topology, for
``tests/distributed/test_multinode_cli.py`` (named by ``--trainer.callbacks+=``).

At train start each rank writes ``<out>/topology.rank<r>.json``: global and local rank, node
rank, world size and node count as the trainer sees them, this rank's part of the epoch's sample
order (the sampler's indices), the per-device and global batch and the scheduler's base
(scaled) learning rate. At train end it writes the model's weights to ``<out>/state.rank<r>.pt``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytorch_lightning as pl
import torch

from ssl_lightning.optim.param_groups import global_batch_size


class TopologyProbe(pl.Callback):
    def __init__(self, out: str) -> None:
        self.out = Path(out)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        loader = trainer.train_dataloader
        sampler = loader.sampler  # type: ignore[union-attr]
        scheduler = trainer.lr_scheduler_configs[0].scheduler
        info = {
            "global_rank": trainer.global_rank,
            "local_rank": trainer.local_rank,
            "node_rank": trainer.node_rank,
            "world_size": trainer.world_size,
            "num_nodes": trainer.num_nodes,
            "sampler_replicas": sampler.num_replicas,
            "sampler_rank": sampler.rank,
            "indices": [int(key[1]) if isinstance(key, (tuple, list)) else int(key)
                        for key in sampler],
            "batch_size": loader.batch_size,  # type: ignore[union-attr]
            "global_batch_size": global_batch_size(trainer),
            "base_lrs": [float(lr) for lr in scheduler.base_lrs],  # type: ignore[attr-defined]
        }
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / f"topology.rank{trainer.global_rank}.json").write_text(json.dumps(info))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        state = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
        torch.save({"state": state, "global_step": trainer.global_step},
                   self.out / f"state.rank{trainer.global_rank}.pt")

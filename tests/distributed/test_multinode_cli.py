"""Two nodes simulated on this machine: two ``torchrun --nnodes 2 --node_rank k`` launches on
localhost (gloo, one process each) run the real CLI, as a 2-node cluster job would.

Checked against one process holding the global batch: every rank sees global rank, node rank
and world size of a 2-node job, the sampler splits the epoch's sample order between the nodes
(disjoint, together the single process's order), the learning rate is scaled by the global
batch (per-device batch × devices × nodes), and after 3 optimizer steps in float64 the weights
equal the single process's to 1e-9 (SimCLR, per-sample augmentations, no BatchNorm).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ssl_lightning.testing.process_pool import free_port

pytestmark = pytest.mark.slow

TESTS = Path(__file__).resolve().parents[1]
STEPS, PER_DEVICE = 3, 4
BACKBONE = ('{"class_path": "ssl_lightning.SmallConvNet", '
            '"init_args": {"widths": [8, 16], "norm": "group"}}')


def _cli_args(data: Path, out: Path, batch: int, num_nodes: int) -> list[str]:
    return [
        "-m", "ssl_lightning", "fit", "--config", "simclr",
        "--data.root", str(data), "--data.batch_size", str(batch), "--data.num_workers", "0",
        "--data.device_transform", "null",
        "--model.init_args.backbone", BACKBONE, "--model.init_args.head_batch_norm", "false",
        "--model.init_args.projection_hidden_dim", "16", "--model.init_args.projection_dim", "8",
        "--model.init_args.warmup_epochs", "0",
        "--trainer.accelerator", "cpu", "--trainer.devices", "1",
        "--trainer.num_nodes", str(num_nodes), "--trainer.strategy",
        "ddp" if num_nodes > 1 else "auto", "--trainer.sync_batchnorm", "false",
        "--trainer.precision", "64-true", "--trainer.max_epochs", "1",
        "--trainer.limit_train_batches", str(STEPS), "--trainer.limit_val_batches", "0",
        "--trainer.num_sanity_val_steps", "0", "--trainer.logger", "false",
        "--trainer.callbacks+=topology_probe.TopologyProbe",
        f"--trainer.callbacks.out={out}",
    ]


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [str(TESTS), str(TESTS.parent), os.environ.get("PYTHONPATH", "")]))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def _read(out: Path, rank: int) -> tuple[dict, dict]:
    info = json.loads((out / f"topology.rank{rank}.json").read_text())
    return info, torch.load(out / f"state.rank{rank}.pt", weights_only=True)


def test_two_simulated_nodes_equal_one_process(tmp_path: Path, tiny_image_folder: Path) -> None:
    port, nodes_out = free_port(), tmp_path / "nodes"
    launches = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
             "--nproc_per_node", "1", "--node_rank", str(node), "--master_addr", "127.0.0.1",
             "--master_port", str(port),
             *_cli_args(tiny_image_folder, nodes_out, PER_DEVICE, 2)],
            cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True)
        for node in (0, 1)]
    single_out = tmp_path / "single"
    single = subprocess.run(
        [sys.executable, *_cli_args(tiny_image_folder, single_out, 2 * PER_DEVICE, 1)],
        cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    logs = [launch.communicate(timeout=300)[0] for launch in launches]
    for launch, log in zip(launches, logs, strict=True):
        assert launch.returncode == 0, log[-3000:]
    assert single.returncode == 0, (single.stdout + single.stderr)[-3000:]

    ref_info, ref = _read(single_out, 0)
    nodes = [_read(nodes_out, rank) for rank in (0, 1)]
    for rank, (info, state) in enumerate(nodes):
        assert (info["global_rank"], info["node_rank"], info["local_rank"]) == (rank, rank, 0)
        assert (info["world_size"], info["num_nodes"]) == (2, 2)
        assert (info["sampler_replicas"], info["sampler_rank"]) == (2, rank)
        assert info["global_batch_size"] == ref_info["global_batch_size"] == 2 * PER_DEVICE
        # simclr.yaml scales lr by sqrt(global batch): the same on 2 nodes as on one process.
        assert info["base_lrs"][0] == ref_info["base_lrs"][0]
        assert math.isclose(ref_info["base_lrs"][0], 0.045 * math.sqrt(2 * PER_DEVICE))
        assert state["global_step"] == ref["global_step"] == STEPS
    # The nodes split the epoch's order (DistributedSampler interleaves: rank r gets r::2).
    rank0, rank1 = nodes[0][0]["indices"], nodes[1][0]["indices"]
    assert not set(rank0) & set(rank1)
    assert rank0 == ref_info["indices"][0::2] and rank1 == ref_info["indices"][1::2]
    # Global batch s of the nodes holds the same samples as the single process's batch s, and
    # every view is a function of its sample: the weights match.
    initial_moved = False
    for key, value in ref["state"].items():
        for _, state in nodes:
            torch.testing.assert_close(state["state"][key], value, rtol=0, atol=1e-9)
        initial_moved |= bool(value.dtype.is_floating_point and value.abs().sum() > 0)
    assert initial_moved

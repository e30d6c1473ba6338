"""Sharded (FSDP2) training = DDP = one process holding the global batch, for every method, and
an exact mid-epoch resume from a distributed checkpoint (see ``tests/sharding_harness.py``: one
pair of processes for all fits, a second, fresh pair for the resume)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from sharding_harness import BATCHNORM, METHODS, WORLD, make_method, run_all, run_resume

from ssl_lightning.distributed.sharding import load_sharded_checkpoint
from ssl_lightning.methods.registry import method_entries
from ssl_lightning.testing.trainer_runs import assert_states_close

pytestmark = pytest.mark.slow

#: float64: the three runs differ by rounding only (measured max |diff| <= 2e-15).
ATOL = 1e-9


def make_runs(tmp_path_factory: pytest.TempPathFactory, make_image_folder) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("sharded")
    make_image_folder(root / "train", classes=2, per_class=12, seed=0)
    make_image_folder(root / "test", classes=2, per_class=6, seed=1)
    ranks = run_all(root)
    single = {**ranks[0]["single"], **ranks[1]["single"]}
    return {"root": root, "single": single, "ranks": ranks, **{k: ranks[0][k] for k in (
        "ddp", "sharded", "straight", "straight_dinov3_gram", "straight_distillation",
        "bad_wrap", "bad_ema", "checkpointed")}}


@pytest.mark.parametrize("name", list(METHODS))
def test_sharded_equals_ddp_equals_one_process(runs: dict[str, Any], name: str) -> None:
    single, ddp, sharded = runs["single"][name], runs["ddp"][name], runs["sharded"][name]
    assert_states_close(ddp, single, atol=ATOL, path=f"{name} ddp")
    assert_states_close(sharded, single, atol=ATOL, path=f"{name} sharded")
    changed = [k for k, v in single.items() if v.is_floating_point()
               and not torch.equal(v, _initial(name)[k])]
    assert changed, f"{name}: nothing trained"


def test_every_registered_method_is_in_the_harness() -> None:
    """Each registered method is trained by the harness unless it opts out of
    ``sharded_equals_ddp`` in the registry, whose reason is printed (so docs/distributed.md's
    "every method" holds)."""
    for entry in method_entries():
        reason = entry.opt_out("sharded_equals_ddp")
        if reason is not None:
            print(f"{entry.name} opts out of sharded_equals_ddp: {reason}")
        assert (entry.name in METHODS) == (reason is None), entry.name
        if reason is None:
            assert type(make_method(entry.name)) is entry.cls, entry.name


def _initial(name: str) -> dict[str, torch.Tensor]:
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        return make_method(name).state_dict()
    finally:
        torch.set_default_dtype(default)


def test_activation_checkpointing_changes_nothing(runs: dict[str, Any]) -> None:
    assert_states_close(runs["checkpointed"], runs["single"]["ibot"], atol=ATOL)


def test_known_bad_variants_are_caught(runs: dict[str, Any]) -> None:
    """A teacher sharded unlike its student is refused; an EMA of gathered copies on rank 0
    leaves the teacher shards behind, which the equality check sees."""
    assert "sharded as units ['']" in runs["bad_wrap"] and "'blocks.0'" in runs["bad_wrap"]
    single = runs["single"]["dino"]
    teacher_gap = max((runs["bad_ema"][k] - v).abs().max().item() for k, v in single.items()
                      if k.startswith("teacher_") and v.numel())
    assert teacher_gap > 1e-3, teacher_gap
    with pytest.raises(AssertionError):
        assert_states_close(runs["bad_ema"], single, atol=ATOL)


def test_sharded_mid_epoch_resume_is_exact(runs: dict[str, Any]) -> None:
    """Step 2 of 3 in epoch 0, resumed in fresh processes, to step 4 (into epoch 1); on one
    process from step 3 (resharded), and refused from step 2 with both layouts named."""
    checkpoint = runs["root"] / "ckpt" / "step=2.ckpt"
    assert checkpoint.is_dir() and len(list(checkpoint.glob("*.distcp"))) == WORLD
    resumed = run_resume(runs["root"])[0]
    straight = runs["straight"]
    assert resumed["global_step"] == straight["global_step"] == 4
    assert_states_close(resumed["state"], straight["state"], atol=0.0)
    assert resumed["one_process"]["global_step"] == 4
    # DINOv3: resumed between its Gram-teacher snapshots (steps 1 and 3), through the second.
    gram = runs["straight_dinov3_gram"]["state"]
    assert int(gram["gram_teacher.snapshot_step"]) == 3
    assert_states_close(resumed["dinov3_gram"]["state"], gram, atol=0.0, path="dinov3")
    # Distillation: its frozen teacher is not in the shards; rebuilt, it resumes exactly.
    distilled = runs["straight_distillation"]["state"]
    assert_states_close(resumed["distillation"]["state"], distilled, atol=0.0,
                        path="distillation")
    assert "'num_replicas': 2" in resumed["refused"] and "'num_replicas': 1" in resumed["refused"]


def test_consolidated_checkpoint_is_the_full_state(runs: dict[str, Any]) -> None:
    checkpoint = load_sharded_checkpoint(runs["root"] / "ckpt" / "step=4.ckpt")
    assert checkpoint["global_step"] == 4 and "backbone_spec" in checkpoint
    assert_states_close(checkpoint["state_dict"], runs["straight"]["state"], atol=0.0)


@pytest.mark.parametrize("name", list(BATCHNORM))
def test_sharded_batchnorm_statistics_are_ddps(runs: dict[str, Any], name: str) -> None:
    """Without SyncBatchNorm each process updates BatchNorm's running statistics from its own
    batch. DDP broadcasts rank 0's buffers before each step and saves rank 0's; the sharded run
    holds the same values on every rank and its checkpoint holds rank 0's."""
    for rank, result in enumerate(runs["ranks"]):
        ddp, sharded = result["bn_ddp"][name], result["bn_sharded"][name]
        assert [k for k in ddp if "running_mean" in k], "no BatchNorm statistics"
        assert_states_close(sharded, ddp, atol=ATOL, path=f"{name} rank {rank}")
    saved = load_sharded_checkpoint(runs["root"] / f"{name}.ckpt")["state_dict"]
    assert_states_close(saved, runs["ranks"][0]["bn_ddp"][name], atol=ATOL, path=f"{name} saved")

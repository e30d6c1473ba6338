"""Sharded (FSDP2) training = DDP = one process holding the global batch, for every method, and
an exact mid-epoch resume from a distributed checkpoint (see ``tests/sharding_harness.py``: one
2-process spawn for all fits, a second, fresh one for the resume)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning_ddp_utils import assert_states_close
from sharding_harness import METHODS, NOT_IN_HARNESS, WORLD, make_method, run_all, run_resume

import ssl_lightning.methods
from ssl_lightning.methods import SSLMethod
from ssl_lightning.sharding import load_sharded_checkpoint

pytestmark = pytest.mark.slow

#: float64: the three runs differ by rounding only (measured max |diff| <= 2e-15).
ATOL = 1e-9


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, make_image_folder) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("sharded")
    make_image_folder(root / "train", classes=2, per_class=12, seed=0)
    make_image_folder(root / "test", classes=2, per_class=6, seed=1)
    ranks = run_all(root)
    single = {**ranks[0]["single"], **ranks[1]["single"]}
    return {"root": root, "single": single, **{k: ranks[0][k] for k in (
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


def test_every_exported_method_is_in_the_harness() -> None:
    """Each method class of ``ssl_lightning.methods.__all__`` is trained by the harness or named
    in its ``NOT_IN_HARNESS`` with a reason (so docs/distributed.md's "every method" holds)."""
    exported = {name for name in ssl_lightning.methods.__all__
                if isinstance(cls := getattr(ssl_lightning.methods, name), type)
                and issubclass(cls, SSLMethod)}
    covered = {type(make_method(name)).__name__ for name in METHODS}
    missing = sorted(exported - covered - set(NOT_IN_HARNESS))
    assert not missing, (f"methods {missing} are not in tests/sharding_harness.py: add them to "
                         "METHODS, or to NOT_IN_HARNESS with the reason")
    assert not covered & set(NOT_IN_HARNESS), "a method in METHODS is also in NOT_IN_HARNESS"
    assert all(NOT_IN_HARNESS.values()), "every exception needs its reason"


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

"""SSLMethod's per-batch reseeding of the model-side randomness: the seed
function, per-rank streams (different stochastic depth on each rank, one shared CPU stream for
MAE / I-JEPA's global-batch masks), fine-tuning ``LinearEval``, the seed's resolution and its
round trip through a checkpoint. The exact resume with stochastic depth is in
``tests/resume/test_resume_exact.py`` (``ibot_vit``)."""

from __future__ import annotations

import itertools

import pytest
import torch

from ssl_lightning.backbones import SmallConvNet, ViT
from ssl_lightning.data.seeding import sample_seed, view_seed
from ssl_lightning.evaluation import LinearEval
from ssl_lightning.methods import DINO, IBOT, MAE, LeJEPA
from ssl_lightning.training.step_rng import shared_step_seed, step_seed


class _OnRank:
    """Mixin: the method believes it runs on rank ``rank`` (what Lightning's DDP would set)."""

    rank = 0

    @property
    def global_rank(self) -> int:
        return self.rank


class RankedDINO(_OnRank, DINO):
    pass


class RankedMAE(_OnRank, MAE):
    pass


class RankedLinearEval(_OnRank, LinearEval):
    pass


class RankedIBOT(_OnRank, IBOT):
    pass


def _vit(drop_path_rate: float) -> ViT:
    return ViT(image_size=16, patch_size=4, embed_dim=8, depth=2, num_heads=2,
               drop_path_rate=drop_path_rate)


def _dino(drop_path_rate: float = 0.5, **kwargs) -> RankedDINO:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    return RankedDINO(_vit(drop_path_rate), head_out_dim=8, head_hidden_dim=8,
                      head_bottleneck_dim=4, **kwargs)


def _student_features(model: _OnRank, rank: int, batch_idx: int) -> torch.Tensor:
    model.rank = rank
    model.reseed_rng(batch_idx)
    with torch.no_grad():
        return model.backbone(torch.ones(6, 3, 16, 16))  # train mode: stochastic depth on


def test_step_seed_is_a_pure_function_distinct_per_argument_and_from_the_data_seeds() -> None:
    seeds = {(s, e, b, r): step_seed(s, e, b, r)
             for s, e, b, r in itertools.product((0, 1), range(3), range(32), range(4))}
    assert len(set(seeds.values())) == len(seeds)  # every (seed, epoch, batch, rank) its own
    assert all(0 <= v < 2**63 for v in seeds.values())
    assert step_seed(1, 2, 3, 1) == seeds[(1, 2, 3, 1)]
    data = {sample_seed(s, e, i) for s, e, i in itertools.product((0, 1), range(3), range(32))}
    data |= {view_seed(d, v) for d in set(data) for v in range(4)}
    assert not data & set(seeds.values())  # no batch shares a stream with a sample or a view


def test_ranks_draw_different_stochastic_depth_and_a_batch_redraws_its_own() -> None:
    model = _dino()
    rank0, rank1 = _student_features(model, 0, 5), _student_features(model, 1, 5)
    assert not torch.equal(rank0, rank1)  # same weights, same input: only the drop masks differ
    assert torch.equal(_student_features(model, 0, 5), rank0)  # replayed from the seed alone
    assert not torch.equal(_student_features(model, 0, 6), rank0)  # the next batch: new masks
    # Control: without stochastic depth the forward is deterministic, whatever the rank.
    plain = _dino(drop_path_rate=0.0)
    assert torch.equal(_student_features(plain, 0, 5), _student_features(plain, 1, 5))


def test_ibot_masks_differ_across_ranks_and_replay_per_batch() -> None:
    torch.manual_seed(0)
    vit = ViT(image_size=16, patch_size=4, embed_dim=8, depth=1, num_heads=2, mask_token=True)
    ibot = RankedIBOT(vit, head_out_dim=8, head_hidden_dim=8, head_bottleneck_dim=4,
                      mask_probability=1.0)

    def masks(rank: int, batch_idx: int) -> torch.Tensor:
        ibot.rank = rank
        ibot.reseed_rng(batch_idx)
        return ibot.draw_masks(8, (4, 4))

    assert torch.equal(masks(0, 2), masks(0, 2))
    assert not torch.equal(masks(0, 2), masks(1, 2))
    assert not torch.equal(masks(0, 2), masks(0, 3))


def test_fine_tuning_linear_eval_is_reseeded_too() -> None:
    torch.manual_seed(0)
    model = RankedLinearEval(_vit(0.5), num_classes=2, checkpoint="random", finetune=True)
    first = _student_features(model, 0, 1)
    assert torch.equal(_student_features(model, 0, 1), first)
    assert not torch.equal(_student_features(model, 1, 1), first)
    checkpoint: dict = {}
    model.on_save_checkpoint(checkpoint)
    assert checkpoint["rng_seed"] == model.rng_seed


def test_mae_ranks_share_the_cpu_stream_of_the_global_batch_masks() -> None:
    torch.manual_seed(0)
    mae = RankedMAE(_vit(0.0), decoder_dim=8, decoder_depth=1, decoder_heads=2, image_size=16)
    dino = _dino()
    draws = {}
    for model, rank in itertools.product((mae, dino), (0, 1)):
        model.rank = rank
        model.reseed_rng(3)
        draws[type(model).__name__, rank] = torch.rand(4)
    assert torch.equal(draws["RankedMAE", 0], draws["RankedMAE", 1])
    assert not torch.equal(draws["RankedDINO", 0], draws["RankedDINO", 1])


def test_the_seed_follows_seed_everything_or_the_argument_and_the_checkpoint_wins(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PL_GLOBAL_SEED", "7")
    assert _dino().rng_seed == 7
    assert _dino(rng_seed=3).rng_seed == 3
    checkpoint: dict = {}
    _dino().on_save_checkpoint(checkpoint)
    monkeypatch.setenv("PL_GLOBAL_SEED", "8")  # a relaunch with another seed_everything
    resumed = _dino()
    resumed.on_load_checkpoint(checkpoint)
    assert resumed.rng_seed == 7
    fresh = _dino()
    assert fresh.rng_seed == 8
    assert not torch.equal(_student_features(resumed, 0, 0), _student_features(fresh, 0, 0))
    monkeypatch.delenv("PL_GLOBAL_SEED")
    torch.manual_seed(11)
    assert DINO(_vit(0.0), head_out_dim=8, head_hidden_dim=8, head_bottleneck_dim=4).rng_seed == 11


def test_step_generator_is_shared_by_the_ranks_and_separates_batches_and_streams() -> None:
    """The shared-decision generator (SIGReg directions, W-MSE splits): a pure function of
    (rng_seed, epoch, batch index, stream), never of the rank, and apart from step_seed."""
    model = LeJEPA(SmallConvNet((4, 8)), projection_hidden_dim=8, projection_dim=4,
                   rng_seed=7)
    model.reseed_rng(3)
    first = torch.randn(5, generator=model.step_generator(1))
    torch.manual_seed(123)  # the global generator does not matter
    assert torch.equal(torch.randn(5, generator=model.step_generator(1)), first)
    assert not torch.equal(torch.randn(5, generator=model.step_generator(2)), first)
    model.reseed_rng(4)
    assert not torch.equal(torch.randn(5, generator=model.step_generator(1)), first)
    seeds = {shared_step_seed(7, 0, 3, s) for s in range(3)}
    assert len(seeds) == 3 and not seeds & {step_seed(7, 0, 3, r) for r in range(8)}

"""SMoG (Pang et al. 2022): the momentum group update against a float64 loop reference of
``g_k ← β g_k + (1 − β) mean_{i: a_i = k} x_i`` (empty groups unchanged), the loss of a step
against a reference of the cross-entropy of cosine scores / τ to the other view's teacher
group, and bad settings failing in ``__init__`` with the value named."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from ssl_lightning.backbones import SmallConvNet
from ssl_lightning.clustering import assign_to_centroids, momentum_group_update
from ssl_lightning.methods import SMoG
from ssl_lightning.methods.registry import method_entry
from ssl_lightning.testing import assert_two_processes_equal_one
from ssl_lightning.testing.trainer_runs import KeyedViews


def _smog(**kwargs) -> SMoG:  # type: ignore[no-untyped-def]
    return SMoG(SmallConvNet((4, 8), norm="group"), projection_hidden_dim=8, projection_dim=4,
                head_batch_norm=False, **{"num_groups": 3, "queue_size": 8, **kwargs})


def test_group_update_matches_the_float64_reference() -> None:
    generator = torch.Generator().manual_seed(0)
    groups = torch.randn(8, 3, generator=generator, dtype=torch.float64)
    rows = torch.randn(6, 3, generator=generator, dtype=torch.float64)
    assignment = assign_to_centroids(rows, groups).tolist()
    expected = groups.clone()
    for k in range(8):
        members = [rows[i] for i, a in enumerate(assignment) if a == k]
        if members:
            expected[k] = 0.9 * groups[k] + 0.1 * sum(members) / len(members)
    assert len(set(assignment)) < 8  # 6 rows: an empty group is part of the check
    assert torch.allclose(momentum_group_update(groups, rows, 0.9), expected, atol=1e-14,
                          rtol=0)


def test_step_loss_matches_the_reference() -> None:
    torch.manual_seed(0)
    model = _smog(num_groups=8, queue_size=16).double()
    views = [torch.randn(8, 3, 8, 8, dtype=torch.float64) for _ in range(2)]
    outputs = model.forward_views(views)
    # groups at teacher projections of both views: their groups differ, so a swap is seen
    model.groups.copy_(F.normalize(torch.cat([outputs["z1"][:4], outputs["z2"][:4]]), dim=1))
    assert not torch.equal(model.groups_of(outputs["z1"]), model.groups_of(outputs["z2"]))
    before = model.groups.clone()
    loss = model.loss_from_outputs(outputs)
    rows = F.normalize(torch.cat([outputs["s1"], outputs["s2"]]), dim=1)
    groups = F.normalize(momentum_group_update(before, rows, 0.99), dim=1).tolist()
    terms = []
    for p, z in (("p1", "z2"), ("p2", "z1")):
        for pred, target in zip(outputs[p].tolist(), outputs[z].tolist(), strict=True):
            norm = math.sqrt(sum(x * x for x in target))
            cos_t = [sum(a * b for a, b in zip(target, g, strict=True)) / norm
                     for g in F.normalize(before, dim=1).tolist()]
            label = max(range(len(cos_t)), key=cos_t.__getitem__)
            pnorm = math.sqrt(sum(x * x for x in pred))
            logits = [sum(a * b for a, b in zip(pred, g, strict=True)) / pnorm / 0.1
                      for g in groups]
            top = max(logits)
            lse = top + math.log(sum(math.exp(x - top) for x in logits))
            terms.append((lse - logits[label]) / len(outputs[p]))
    assert abs(float(loss) - sum(terms) / 2) < 1e-12


def test_bad_settings_fail() -> None:
    with pytest.raises(ValueError, match="num_groups must be >= 1, got 0"):
        _smog(num_groups=0)
    with pytest.raises(ValueError, match=r"group_momentum must be in \[0, 1\), got 1.0"):
        _smog(group_momentum=1.0)
    with pytest.raises(ValueError, match="num_groups=9 exceeds queue_size=8"):
        _smog(num_groups=9)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        _smog(temperature=0.0)


class _LocalGroupsSMoG(SMoG):
    """Known-bad: groups and bank moved by this rank's projections only."""

    def gather_no_grad(self, x: torch.Tensor) -> torch.Tensor:
        return x


def _local_groups() -> SMoG:
    model = method_entry("smog").small(optimizer="sgd", lr=0.5, lr_scaling="none",
                                       warmup_epochs=0)
    model.__class__ = _LocalGroupsSMoG
    return model


@pytest.mark.slow
def test_groups_moved_by_each_rank_alone_differ_from_one_process() -> None:
    with pytest.raises(AssertionError, match="2 processes differ from 1 process"):
        assert_two_processes_equal_one(_local_groups, KeyedViews(24, (8, 8)))

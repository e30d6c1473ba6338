"""AttentiveEval: the pooling equals a float64 reference written out here (AIM's attention
alone, and V-JEPA's cross-attention block with its residual and MLP against torch's
MultiheadAttention), is invariant to the order of the tokens, and solves a task a mean-pooled
linear probe cannot (the class lives in one marked token whose position varies; the mean of
the tokens is the same for every class)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from evaluation_helpers import tiny_trainer
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from ssl_lightning.backbones import ViT
from ssl_lightning.evaluation import AttentiveEval, LinearEval
from ssl_lightning.evaluation.attentive import AttentivePooling


def _reference_pooling(pool: AttentivePooling, tokens: Tensor) -> Tensor:
    """Loops over samples, queries and heads: softmax_n(q_h · k_hn / sqrt(d_h)) v_hn."""
    d = tokens.shape[-1]
    heads = pool.num_heads
    dh = d // heads
    ln = pool.norm
    out = torch.zeros(tokens.shape[0], d, dtype=tokens.dtype)
    for b, sample in enumerate(tokens):
        normed = [(t - t.mean()) / torch.sqrt(t.var(unbiased=False) + ln.eps) * ln.weight
                  + ln.bias for t in sample]
        keys = [pool.k_proj.weight @ t + pool.k_proj.bias for t in normed]
        values = [pool.v_proj.weight @ t + pool.v_proj.bias for t in normed]
        pooled = torch.zeros(d, dtype=tokens.dtype)
        for query in pool.queries:
            q = pool.q_proj.weight @ query + pool.q_proj.bias
            joined = []
            for h in range(heads):
                part = slice(h * dh, (h + 1) * dh)
                logits = torch.stack([q[part] @ k[part] / math.sqrt(dh) for k in keys])
                weights = logits.exp() / logits.exp().sum()
                joined.append(sum(w * v[part] for w, v in zip(weights, values, strict=True)))
            pooled += pool.out_proj.weight @ torch.cat(joined) + pool.out_proj.bias
        out[b] = pooled / len(pool.queries)
    return out


def test_pooling_equals_the_reference_and_ignores_token_order() -> None:
    torch.manual_seed(0)
    pool = AttentivePooling(8, num_heads=2, num_queries=3).double()
    for p in pool.parameters():  # away from the initial values (LayerNorm's ones and zeros)
        p.data.add_(0.3 * torch.randn_like(p))
    tokens = torch.randn(4, 5, 8, dtype=torch.float64)
    with torch.no_grad():
        out = pool(tokens)
        torch.testing.assert_close(out, _reference_pooling(pool, tokens), rtol=0, atol=1e-12)
        permuted = pool(tokens[:, torch.randperm(5)])
    torch.testing.assert_close(permuted, out, rtol=0, atol=1e-12)


def test_known_bad_head_split_differs_from_the_reference() -> None:
    """Known-bad: the same weights attending as one head of 8 channels, not two of 4."""
    torch.manual_seed(0)
    pool = AttentivePooling(8, num_heads=2).double()
    pool.queries.data.normal_()
    tokens = torch.randn(2, 5, 8, dtype=torch.float64)
    reference = _reference_pooling(pool, tokens)
    one_head = AttentivePooling(8, num_heads=1).double()
    one_head.load_state_dict(pool.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(pool(tokens), reference, rtol=0, atol=1e-12)
        assert not torch.allclose(one_head(tokens), reference, atol=1e-6)


def _reference_block(pool: AttentivePooling, tokens: Tensor) -> Tensor:
    """V-JEPA's cross-attention block from torch's MultiheadAttention with the pool's weights:
    a = q + MHA(q, LN(x), LN(x)); a + MLP(LN(a)); averaged over the queries."""
    d = tokens.shape[-1]
    mha = nn.MultiheadAttention(d, pool.num_heads, batch_first=True, dtype=tokens.dtype)
    with torch.no_grad():
        mha.in_proj_weight.copy_(torch.cat([pool.q_proj.weight, pool.k_proj.weight,
                                            pool.v_proj.weight]))
        mha.in_proj_bias.copy_(torch.cat([pool.q_proj.bias, pool.k_proj.bias,
                                          pool.v_proj.bias]))
        mha.out_proj.load_state_dict(pool.out_proj.state_dict())
    normed = nn.functional.layer_norm(tokens, (d,), pool.norm.weight, pool.norm.bias,
                                      pool.norm.eps)
    queries = pool.queries.expand(len(tokens), -1, -1)
    a = queries + mha(queries, normed, normed, need_weights=False)[0]
    fc1, fc2, norm = pool.mlp[0], pool.mlp[2], pool.mlp_norm
    hidden = nn.functional.layer_norm(a, (d,), norm.weight, norm.bias, norm.eps)
    a = a + nn.functional.linear(nn.functional.gelu(
        nn.functional.linear(hidden, fc1.weight, fc1.bias)), fc2.weight, fc2.bias)
    return a.mean(dim=1)


class _NoMLPNorm(AttentivePooling):
    """Known-bad: the MLP block reads the queries without its LayerNorm."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.mlp_norm = nn.Identity()  # type: ignore[assignment]


@pytest.mark.parametrize("pool_class, equal", [(AttentivePooling, True), (_NoMLPNorm, False)])
def test_vjepa_block_equals_multihead_attention_reference(pool_class: type, equal: bool) -> None:
    torch.manual_seed(0)
    pool = pool_class(8, num_heads=2, num_queries=3, mlp_ratio=2.0).double()
    reference_pool = AttentivePooling(8, num_heads=2, num_queries=3, mlp_ratio=2.0).double()
    for p in pool.parameters():  # away from the initial values (LayerNorm's ones and zeros)
        p.data.add_(0.3 * torch.randn_like(p))
    reference_pool.load_state_dict(pool.state_dict(), strict=False)
    reference_pool.mlp_norm.load_state_dict(  # the known-bad pool's norm is an Identity
        {"weight": 1 + 0.3 * torch.randn(8, dtype=torch.float64),
         "bias": 0.3 * torch.randn(8, dtype=torch.float64)} if not equal
        else pool.mlp_norm.state_dict())
    tokens = torch.randn(4, 5, 8, dtype=torch.float64)
    with torch.no_grad():
        out, reference = pool(tokens), _reference_block(reference_pool, tokens)
        assert torch.allclose(out, reference, rtol=0, atol=1e-12) == equal
        torch.testing.assert_close(pool(tokens[:, torch.randperm(5)]), out, rtol=0, atol=1e-12)
    assert pool.mlp[0].out_features == 16


def test_vjepa_block_is_the_default_and_mlp_ratio_null_is_the_old_head() -> None:
    torch.manual_seed(0)
    vit = ViT(image_size=8, patch_size=4, embed_dim=8, depth=2, num_heads=2)
    block = AttentiveEval(vit, 3, checkpoint="random").classifier.heads[0][0]
    assert block.mlp is not None and block.mlp[0].out_features == 32  # mlp_ratio 4
    assert float(block.out_proj.weight.std()) < 0.02 and not block.q_proj.bias.any()
    old = AttentiveEval(vit, 3, checkpoint="random", mlp_ratio=None).classifier.heads[0][0]
    assert old.mlp is None
    assert set(old.state_dict()) == {"queries", "norm.weight", "norm.bias", "q_proj.weight",
                                     "q_proj.bias", "k_proj.weight", "k_proj.bias",
                                     "v_proj.weight", "v_proj.bias", "out_proj.weight",
                                     "out_proj.bias"}
    with pytest.raises(ValueError, match="mlp_ratio must be > 0"):
        AttentiveEval(vit, 3, checkpoint="random", mlp_ratio=0.0)


class TokenBackbone(nn.Module):
    """A 'backbone' whose inputs already are its tokens (B, 1 + N, D): one identity block, no
    norm; its pooled output is the first token."""

    num_prefix_tokens = 1

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Identity()])
        self.norm = nn.Identity()
        self.embed_dim = self.num_features = dim

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return x[:, 0]


def marked_token_task(n: int, seed: int, tokens: int = 8) -> TensorDataset:
    """Each sample: a [CLS] of zeros and ``tokens`` tokens (value, marker, 0, 0) whose values are
    half +1 and half -1 (so their mean is 0) and one of which, at a random place, is marked; the
    class is the sign of the marked token. Every class has the same mean token."""
    g = torch.Generator().manual_seed(seed)
    x = torch.zeros(n, 1 + tokens, 4)
    targets = torch.arange(n) % 2
    for i in range(n):
        values = torch.tensor([1.0, -1.0]).repeat_interleave(tokens // 2)
        values = values[torch.randperm(tokens, generator=g)]
        marked = int(torch.randint(tokens, (1,), generator=g))
        if (values[marked] > 0) != bool(targets[i]):
            values = -values
        x[i, 1:, 0] = values
        x[i, 1 + marked, 1] = 1.0
    return TensorDataset(x, targets)


def test_attentive_probe_solves_what_a_mean_pooled_probe_cannot() -> None:
    train, val = marked_token_task(64, 0), marked_token_task(32, 1)
    mean_tokens = train.tensors[0][:, 1:].mean(dim=1)
    assert torch.equal(mean_tokens[train.tensors[1] == 0].unique(dim=0),
                       mean_tokens[train.tensors[1] == 1].unique(dim=0))  # one point for all
    results = {}
    for name, model in (
            ("mean", LinearEval(TokenBackbone(4), 2, checkpoint="random", lr_scaling="none",
                                lrs=[0.1, 1.0], poolings=["mean"])),
            ("attentive", AttentiveEval(TokenBackbone(4), 2, checkpoint="random",
                                        lr_scaling="none", lrs=[3e-3, 1e-2],
                                        weight_decays=[0.0], num_heads=1))):
        torch.manual_seed(0)
        trainer = tiny_trainer(max_epochs=40, check_val_every_n_epoch=40)
        trainer.fit(model, DataLoader(train, batch_size=16, shuffle=True),
                    [DataLoader(val, batch_size=32)])
        results[name] = float(trainer.callback_metrics["val/top1"])
    assert results["mean"] == 50.0  # identical features for both classes: chance exactly
    assert results["attentive"] >= 95.0, results


def test_attentive_eval_on_a_vit_with_a_grid() -> None:
    torch.manual_seed(0)
    vit = ViT(image_size=8, patch_size=4, embed_dim=8, depth=2, num_heads=2)
    model = AttentiveEval(vit, 3, checkpoint="random", lrs=[1e-3, 1e-2], weight_decays=[0.0, 0.05],
                          last_blocks=[1, 2], num_heads=2, num_queries=2)
    assert len(model.classifier.heads) == 8
    assert {h[1].in_features for h in model.classifier.heads} == {8, 16}
    x, y = torch.randn(12, 3, 8, 8), torch.arange(12) % 3
    trainer = tiny_trainer(max_epochs=1)
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=4),
                [DataLoader(TensorDataset(x, y), batch_size=6)])
    (optimizer,) = trainer.optimizers
    assert isinstance(optimizer, torch.optim.AdamW)
    decays = {id(p): g["weight_decay"] for g in optimizer.param_groups for p in g["params"]}
    head = model.classifier.heads[1]
    assert decays[id(head[0].queries)] == 0.05 and decays[id(head[0].norm.weight)] == 0.0
    assert decays[id(head[0].mlp[0].weight)] == 0.05 and decays[id(head[0].mlp_norm.bias)] == 0.0
    assert 0.0 <= float(trainer.callback_metrics["val/top1"]) <= 100.0


def test_cnn_backbones_and_the_tokens_source_in_linear_eval_are_refused() -> None:
    from ssl_lightning.backbones import SmallConvNet

    with pytest.raises(ValueError, match="needs a token backbone"):
        AttentiveEval(SmallConvNet((8,)), 3, checkpoint="random")
    with pytest.raises(ValueError, match="tokens source is AttentiveEval's"):
        LinearEval(TokenBackbone(4), 3, checkpoint="random", poolings=["tokens"])
    with pytest.raises(ValueError, match="num_heads .* must divide"):
        AttentiveEval(TokenBackbone(4), 3, checkpoint="random", num_heads=3)


def test_a_checkpoint_from_before_mlp_ratio_loads_as_the_old_head(tmp_path: Path) -> None:
    torch.manual_seed(0)
    vit = ViT(image_size=8, patch_size=4, embed_dim=8, depth=2, num_heads=2)
    x, y = torch.randn(8, 3, 8, 8), torch.arange(8) % 3
    trainer = tiny_trainer(max_epochs=1, default_root_dir=tmp_path)
    trainer.fit(AttentiveEval(vit, 3, checkpoint="random", mlp_ratio=None),
                DataLoader(TensorDataset(x, y), batch_size=4),
                [DataLoader(TensorDataset(x, y), batch_size=4)])
    path = tmp_path / "old.ckpt"
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=True)
    del saved["hyper_parameters"]["mlp_ratio"]  # as written before the option existed
    torch.save(saved, path)
    with pytest.warns(FutureWarning, match="before mlp_ratio existed"):
        loaded = AttentiveEval.load_from_checkpoint(path, backbone=vit)
    assert loaded.classifier.heads[0][0].mlp is None and loaded.hparams["mlp_ratio"] is None
    state = loaded.state_dict()
    assert all(torch.equal(state[k], v) for k, v in saved["state_dict"].items())

"""MoCo v2+ with one queue per view: Chen, Fan, Girshick & He, "Improved Baselines with Momentum
Contrastive Learning", arXiv:2003.04297, with the symmetric loss and per-view queues of
solo-learn's ``mocov2plus`` (its CIFAR-10 recipe: 92.94 % linear).

Both views are queries and keys: ``(L(q1, k2, Q2) + L(q2, k1, Q1)) / 2``, where ``Q2`` holds the
view-2 keys of earlier batches and ``Q1`` the view-1 keys. Both queues receive the gathered keys
of their view every step, so every rank holds the same two queues. Everything else (heads, EMA
key encoder, shuffle-BN) is :class:`MoCoV2`'s.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from ssl_lightning.methods.moco_v2 import MoCoV2
from ssl_lightning.methods.registry import SMALL_CONVNET_ARGS, TWO_VIEWS, Paper, register_method
from ssl_lightning.queues import FeatureQueue
from ssl_lightning.training.ema import Schedule


@register_method(
    "moco_v2_plus", title="MoCo v2+", configs=("moco_v2_plus.yaml",),
    paper=Paper("Improved Baselines with Momentum Contrastive Learning", 2020, "2003.04297"),
    family="contrastive", views=TWO_VIEWS, tests="tests/methods/test_moco_v2_plus.py",
    cli_args={
        "moco_v2_plus.yaml": (*SMALL_CONVNET_ARGS, "--model.init_args.projection_hidden_dim", "64"),
    },
    small=lambda backbone, **kw: MoCoV2Plus(backbone, projection_hidden_dim=16, projection_dim=8,
                                            queue_size=16, **kw),
)
class MoCoV2Plus(MoCoV2):
    """MoCo v2+: :class:`MoCoV2` with the symmetric loss and a queue of keys for each view.

    Args:
        backbone: Feature extractor (see :class:`SSLMethod`).
        queue_size: Negatives per queue (solo-learn CIFAR: 32768); a multiple of the global batch.
        momentum_base: Key-encoder momentum at step 0 (solo-learn: 0.99).
        momentum_end: Momentum at the last step (solo-learn: 0.999).
        momentum_schedule: ``"cosine"`` (solo-learn) or ``"constant"``.
        **kwargs: Other arguments of :class:`MoCoV2` (``symmetric`` must stay ``True``).
    """

    def __init__(
        self,
        backbone: nn.Module,
        queue_size: int = 32768,
        momentum_base: float = 0.99,
        momentum_end: float = 0.999,
        momentum_schedule: Schedule = "cosine",
        **kwargs: Any,
    ) -> None:
        if not kwargs.pop("symmetric", True):
            raise ValueError("MoCoV2Plus is symmetric by definition (both views are queries), got "
                             "symmetric=False; remove it, or use MoCoV2 for the one-way loss.")
        super().__init__(backbone, queue_size=queue_size, symmetric=True,
                         momentum_base=momentum_base, momentum_end=momentum_end,
                         momentum_schedule=momentum_schedule, **kwargs)
        # self.queue (MoCoV2's) holds the view-2 keys; this one the view-1 keys.
        self.queue_view1 = FeatureQueue(queue_size, self.projection_dim, seed=1)

    def loss_from_outputs(self, outputs: dict[str, Any]) -> Tensor:
        loss = (self.criterion(outputs["query1"], outputs["key2"], self.queue.negatives())
                + self.criterion(outputs["query2"], outputs["key1"],
                                 self.queue_view1.negatives())) / 2
        self.queue.enqueue(self.gather_no_grad(outputs["key2"]))
        self.queue_view1.enqueue(self.gather_no_grad(outputs["key1"]))
        return loss

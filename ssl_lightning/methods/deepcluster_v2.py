"""DeepCluster v2: Caron et al., "Unsupervised Learning of Visual Features by Contrasting
Cluster Assignments", NeurIPS 2020, Appendix A (and the official ``main_deepclusterv2.py``).

Backbone → projection MLP → L2 normalisation → several prototype heads. At the start of every
epoch the bank of every sample's latest embedding (:class:`~ssl_lightning.clustering.
DatasetBank`, one per assigned crop) is clustered by spherical k-means, head ``h`` on the bank
of crop ``h % 2`` with ``num_prototypes[h]`` clusters; the prototypes are set to the centroids
and every crop of a sample is trained to predict its sample's cluster (:class:`DeepClusterLoss`,
temperature 0.1). The bank rows are written at the samples' dataset indices, which the method
derives from the sample seeds of the batch (:func:`~ssl_lightning.data.seeding.sample_indices`).

Before the first k-means of a fresh run (``init_bank="forward"``, the official ``init_memory``)
the bank is filled by one no-grad pass of backbone + projector over the training set: each rank
embeds its epoch-0 share with the views of epoch 0's sample seeds
(:func:`~ssl_lightning.training.train_set_pass.epoch0_batches`), in train mode as the official
code (BatchNorm with batch statistics; its running statistics restored afterwards), and writes
the gathered rows, so epoch 0 clusters real embeddings. A resumed run takes the bank from its
checkpoint and does not repeat the pass.

Every rank holds the same bank (written from the gathered batch) and k-means sums its
statistics over ranks, so N processes give the centroids and assignments of one; the bank, the
assignments and the epoch they belong to are buffers, so a run resumed mid-epoch (where
Lightning does not call ``on_train_epoch_start`` again) keeps the epoch's assignments.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Literal, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ssl_lightning._lightning import isolate_rng, rank_zero_info
from ssl_lightning.backbones.multicrop import forward_by_resolution
from ssl_lightning.clustering import DatasetBank
from ssl_lightning.data.seeding import sample_indices, sample_seed
from ssl_lightning.distributed.sharding import copy_full
from ssl_lightning.heads import ProjectionHead, SwAVPrototypes
from ssl_lightning.losses import DeepClusterLoss
from ssl_lightning.methods.base import SSLMethod
from ssl_lightning.methods.registry import MULTI_CROP, SMALL_CONVNET_ARGS, Paper, register_method
from ssl_lightning.training.sample_rng import keyed_forward
from ssl_lightning.training.train_set_pass import epoch0_batches, train_mode_unchanged_state

CROPS_FOR_ASSIGN = 2


@register_method(
    "deepcluster_v2", title="DeepCluster v2", configs=("deepcluster_v2.yaml",),
    paper=Paper("Unsupervised Learning of Visual Features by Contrasting Cluster Assignments",
                2020, "2006.09882"),
    family="clustering", views=MULTI_CROP, tests="tests/methods/test_deepcluster_v2.py",
    needs_sample_seeds=True,
    opt_outs={"micro_batching_seedless": (
        "its loss reads each sample's dataset index from the batch's sample seeds, "
        "and batches without them are refused before the first step")},
    cli_args={
        "deepcluster_v2.yaml": (*SMALL_CONVNET_ARGS,
                                "--model.init_args.projection_hidden_dim", "64",
                                "--model.init_args.num_prototypes", "[4, 3]"),
    },
    matrix_args={
        "deepcluster_v2.yaml": ("--model.init_args.num_prototypes", "[4, 3]"),
    },
    small=lambda backbone, **kw: DeepClusterV2(backbone, projection_hidden_dim=16,
                                               projection_dim=8, head_batch_norm=False,
                                               num_prototypes=(6, 4), kmeans_iterations=3, **kw),
)
class DeepClusterV2(SSLMethod):
    """DeepCluster v2 with multi-crop batches ``[global_1, global_2, local_1, ...]``.

    Args:
        backbone: Feature extractor (see :class:`SSLMethod`).
        projection_hidden_dim: Hidden width of the 2-layer projection MLP (2048).
        projection_dim: Embedding size (128).
        head_batch_norm: BatchNorm in the projection MLP (off for BatchNorm-free tests).
        num_prototypes: Clusters of each prototype head (paper: 3 heads of 3000).
        temperature: tau of the prediction softmax (0.1).
        kmeans_iterations: k-means rounds at each epoch start (10 in the official code).
        kmeans_seed: Seed of the initial centroids (with the epoch and head) and of the bank's
            initial rows.
        init_bank: How a fresh run fills the bank before its first k-means: ``"forward"`` (the
            official code) embeds every training sample with the untrained network (one
            no-grad forward of the two global crops over the data); ``"random"`` keeps seeded
            random unit rows (epoch 0 then trains on a random partition).
        projector: A projection head replacing the MLP above (backbone features to
            ``projection_dim``).
        **kwargs: Optimiser arguments of :class:`SSLMethod`.
    """

    views_used = None  # every multi-crop view
    batch_coupled_loss = False  # the targets come from the bank, not from the batch
    data_sized_state = ("bank.embeddings", "assignments")  # one row per training sample

    assignments: Tensor
    clustered_epoch: Tensor

    def __init__(
        self,
        backbone: nn.Module,
        projection_hidden_dim: int = 2048,
        projection_dim: int = 128,
        head_batch_norm: bool = True,
        num_prototypes: Sequence[int] = (3000, 3000, 3000),
        temperature: float = 0.1,
        kmeans_iterations: int = 10,
        kmeans_seed: int = 0,
        projector: nn.Module | None = None,
        init_bank: Literal["forward", "random"] = "forward",
        **kwargs: Any,
    ) -> None:
        super().__init__(backbone, **kwargs)
        if init_bank not in ("forward", "random"):
            raise ValueError(f"init_bank must be 'forward' or 'random', got {init_bank!r}.")
        if not num_prototypes or min(num_prototypes) < 1:
            raise ValueError(f"num_prototypes must be a non-empty list of cluster counts >= 1, "
                             f"got {list(num_prototypes)}.")
        if kmeans_iterations < 1:
            raise ValueError(f"kmeans_iterations must be >= 1, got {kmeans_iterations}.")
        self.projector = self.build_head("projector", projector, lambda: ProjectionHead(
            self.feature_dim, projection_hidden_dim, projection_dim, num_layers=2,
            batch_norm=head_batch_norm,
        ), self.feature_dim, projection_dim, "projection_dim")
        self.prototypes = nn.ModuleList(SwAVPrototypes(projection_dim, k)
                                        for k in num_prototypes)
        self.bank = DatasetBank(CROPS_FOR_ASSIGN, projection_dim, seed=kmeans_seed)
        self.register_buffer("assignments", torch.zeros(len(num_prototypes), 0,
                                                        dtype=torch.long))
        self.register_buffer("clustered_epoch", torch.full((), -1, dtype=torch.long))
        self.num_prototypes, self.temperature = tuple(num_prototypes), temperature
        self.kmeans_iterations, self.kmeans_seed = kmeans_iterations, kmeans_seed
        self.init_bank = init_bank

    def build_criterion(self) -> nn.Module:
        return DeepClusterLoss(self.temperature)

    # ------------------------------------------------------------------------- data indices
    def seeded_dataset(self) -> Any:
        """The train dataset that seeds the samples (``SeededDataset``: a ``seed`` and a
        length), found through the loader's ``dataset`` (and wrappers' ``dataset``)."""
        dataset = getattr(self.trainer.train_dataloader, "dataset", None)
        while dataset is not None and not isinstance(getattr(dataset, "seed", None), int):
            dataset = getattr(dataset, "dataset", None)
        if dataset is None:
            raise ValueError(
                "DeepClusterV2 needs each sample's dataset index, derived from its seed: train "
                "with the package's data modules (SeededDataset batches (views, targets, "
                "sample_seeds)).")
        return dataset

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Size the bank and the assignments like the checkpoint's before its weights load."""
        super().on_load_checkpoint(checkpoint)
        state = checkpoint.get("state_dict", {})
        if "bank.embeddings" in state:
            self.bank.resize_(state["bank.embeddings"].shape[1])
            self.assignments = torch.zeros_like(state["assignments"]).to(self.device)

    def on_fit_start(self) -> None:
        """Size the bank to the train set; refuse more clusters than samples."""
        super().on_fit_start()
        size = len(self.seeded_dataset())
        if max(self.num_prototypes) > size:
            raise ValueError(
                f"DeepClusterV2 num_prototypes={list(self.num_prototypes)} asks for "
                f"more clusters than the {size} training samples; use at most {size}.")
        if self.bank.dataset_size == 0:
            self.bank.resize_(size)
            self.bank.to(self.device)
            self.assignments = torch.zeros(len(self.prototypes), size, dtype=torch.long,
                                           device=self.device)
            if self.init_bank == "forward":
                self.fill_bank()
        elif self.bank.dataset_size != size:
            raise ValueError(
                f"The checkpoint's DeepClusterV2 bank holds {self.bank.dataset_size} samples, "
                f"the train set {size}: resume on the same training data.")

    def on_train_epoch_start(self) -> None:
        """k-means of the bank, once per epoch (``clustered_epoch`` guards a repeated call)."""
        epoch = self.current_epoch
        if int(self.clustered_epoch) >= epoch:
            return
        seed = sample_seed(self.kmeans_seed, epoch, 0)
        centroids, assignments = self.bank.cluster(list(self.num_prototypes),
                                                   self.kmeans_iterations, seed)
        with torch.no_grad():
            for head, c in zip(self.prototypes, centroids, strict=True):
                copy_full(cast(SwAVPrototypes, head).weight, c)  # sharded or not
        self.assignments.copy_(assignments)
        self.clustered_epoch.fill_(epoch)

    @torch.no_grad()
    def fill_bank(self) -> None:
        """The official ``init_memory``: embed this rank's share of the training set (epoch-0
        views, no gradients, train mode) and write the gathered rows into the bank."""
        dataset, start = self.seeded_dataset(), time.perf_counter()
        with train_mode_unchanged_state(self.backbone, self.projector), isolate_rng():
            batches = epoch0_batches(self.trainer)
            for batch_idx, (views, _, seeds) in enumerate(batches):
                with keyed_forward(self.sample_keys(seeds, batch_idx)), \
                        self.trainer.precision_plugin.forward_context():
                    assigned = self.forward_views(views[:CROPS_FOR_ASSIGN])["assigned"]
                self.write_bank(sample_indices(seeds, dataset.seed, 0, len(dataset)), assigned)
        rank_zero_info(f"DeepClusterV2: bank filled by a forward pass over the {len(dataset)} "
                       f"training samples in {time.perf_counter() - start:.0f} s.")

    def write_bank(self, indices: Tensor, assigned: Tensor) -> None:
        """Write the embeddings (B, 2, D) of this rank's samples ``indices`` and every other
        rank's (gathered) into the bank."""
        self.bank.write(self.gather_no_grad(indices),
                        self.gather_no_grad(assigned).transpose(0, 1))

    # ------------------------------------------------------------------------------ the step
    def forward_views(self, views: Sequence[Tensor]) -> dict[str, Any]:
        """Per sample: the scores (B, V, K_h) of every head and the embeddings (B, 2, D) of the
        two global crops."""
        if len(views) < CROPS_FOR_ASSIGN:
            raise ValueError(f"DeepClusterV2 needs 2 global views (+ local views), got "
                             f"{len(views)}.")
        batch = views[0].shape[0]
        features = forward_by_resolution(self.backbone, views)
        z = F.normalize(self.projector(features), dim=1).view(len(views), batch, -1)
        z = z.transpose(0, 1)
        return {"scores": [head(z) for head in self.prototypes],
                "assigned": z[:, :CROPS_FOR_ASSIGN].detach(), "features": features[:batch]}

    def loss_from_outputs(self, outputs: dict[str, Any]) -> Tensor:
        seeds = outputs.get("sample_seeds")
        if seeds is None:
            raise ValueError(
                "DeepClusterV2 needs batches (views, targets, sample_seeds) to find each "
                "sample's dataset index: train with the package's data modules.")
        dataset = self.seeded_dataset()
        indices = sample_indices(seeds, dataset.seed, self.current_epoch, len(dataset))
        loss = self.criterion(outputs["scores"], self.assignments[:, indices])
        self.write_bank(indices, outputs["assigned"])
        return loss

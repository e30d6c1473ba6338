"""IterNorm: iterative group whitening by Newton–Schulz iterations.

Huang, Zhou, Zhu, Liu & Shao, "Iterative Normalization: Beyond Standardization towards Efficient
Whitening", CVPR 2019, Algorithm 1: the F features are split into G groups of c = F/G; for each
group, with the batch mean μ and covariance ``Σ = 1/m Σ_n (x_n − μ)(x_n − μ)ᵀ + ε I``,

``Σ_N = Σ / tr(Σ)``,  ``P_0 = I``,  ``P_k = ½ (3 P_{k−1} − P_{k−1}³ Σ_N)``,
``W = P_T / sqrt(tr(Σ))``,  ``x̂ = W (x − μ)``,

an approximation of ZCA whitening ``Σ^{−1/2}`` that is differentiated through its T iterations
by autograd. In training the running mean and whitening matrix (persistent buffers, so they are
in the checkpoint) follow the batch values with ``momentum``; in evaluation they replace them.
An affine scale and shift follow (initialised to 1 and 0).

With ``sync`` the mean and covariance are sums over all ranks through the autograd-aware
:func:`~ssl_lightning.distributed.all_reduce_sum_with_grad` (the whitening of the global batch,
as ``SyncBatchNorm`` for BatchNorm); without a process group it is the identity.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ssl_lightning.distributed import all_reduce_sum_with_grad


class IterNorm(nn.Module):
    """Group whitening of (N, F) inputs by T Newton–Schulz iterations.

    Args:
        num_features: F.
        num_groups: G; must divide F (groups of F/G consecutive features).
        iterations: T (5).
        eps: ε added to the covariance diagonal (1e-5).
        momentum: Weight of the batch value in the running statistics (0.1).
        affine: Learned per-feature scale and shift after the whitening.
        sync: Batch statistics over all ranks (autograd-aware all-reduce).
    """

    def __init__(self, num_features: int, num_groups: int = 64, iterations: int = 5,
                 eps: float = 1e-5, momentum: float = 0.1, affine: bool = True,
                 sync: bool = True) -> None:
        super().__init__()
        if num_groups < 1 or num_features % num_groups:
            raise ValueError(f"IterNorm num_groups={num_groups} must be >= 1 and divide "
                             f"num_features={num_features}.")
        if iterations < 1:
            raise ValueError(f"IterNorm iterations must be >= 1, got {iterations}.")
        if not eps > 0:
            raise ValueError(f"IterNorm eps must be > 0, got {eps}.")
        if not 0 < momentum <= 1:
            raise ValueError(f"IterNorm momentum must be in (0, 1], got {momentum}.")
        self.num_groups, self.iterations = num_groups, iterations
        self.eps, self.momentum, self.sync = eps, momentum, sync
        channels = num_features // num_groups
        self.register_buffer("running_mean", torch.zeros(num_groups, channels))
        self.register_buffer("running_whitening",
                             torch.eye(channels).repeat(num_groups, 1, 1))
        self.weight = nn.Parameter(torch.ones(num_features)) if affine else None
        self.bias = nn.Parameter(torch.zeros(num_features)) if affine else None
        self._channels = channels

    def forward(self, x: Tensor) -> Tensor:
        """Whitened (N, F) features, in fp32 (fp64 stays fp64) with autocast off."""
        with torch.autocast(device_type=x.device.type, enabled=False):
            return self._whiten(x.to(torch.promote_types(x.dtype, torch.float32)))

    def _whiten(self, x: Tensor) -> Tensor:
        batch = x.shape[0]
        groups = x.view(batch, self.num_groups, self._channels).transpose(0, 1)  # (G, N, c)
        if self.training:
            mean, whitening = self._batch_statistics(groups)
            with torch.no_grad():
                self.running_mean.lerp_(mean.detach().to(self.running_mean.dtype),
                                        self.momentum)
                self.running_whitening.lerp_(
                    whitening.detach().to(self.running_whitening.dtype), self.momentum)
        else:
            mean, whitening = self.running_mean.to(x.dtype), self.running_whitening.to(x.dtype)
        out = (groups - mean.unsqueeze(1)) @ whitening.transpose(1, 2)
        out = out.transpose(0, 1).reshape(batch, -1)
        if self.weight is not None and self.bias is not None:
            out = out * self.weight + self.bias
        return out

    def _batch_statistics(self, groups: Tensor) -> tuple[Tensor, Tensor]:
        """Mean (G, c) and whitening matrix (G, c, c) of the (global) batch."""
        reduce = all_reduce_sum_with_grad if self.sync else (lambda t: t)
        count = groups.new_full((1,), groups.shape[1])
        sums = reduce(torch.cat([groups.sum(dim=1).flatten(), count]))
        n = sums[-1]
        mean = (sums[:-1] / n).view(self.num_groups, self._channels)
        centred = groups - mean.unsqueeze(1)
        eye = torch.eye(self._channels, dtype=groups.dtype, device=groups.device)
        cov = reduce(centred.transpose(1, 2) @ centred) / n + self.eps * eye
        trace = cov.diagonal(dim1=1, dim2=2).sum(dim=1).view(-1, 1, 1)
        normalised = cov / trace
        p = eye.expand_as(cov)
        for _ in range(self.iterations):
            p = 1.5 * p - 0.5 * torch.linalg.matrix_power(p, 3) @ normalised
        return mean, p / trace.sqrt()

"""A first-in-first-out memory bank of object representations: CrIBo's queue.

Lebailly et al., "CrIBo: Self-Supervised Learning via Cross-Image Object-Level Bootstrapping",
ICLR 2024, §3.2: the teacher's object representations of earlier batches, both views of each
object, in which the objects of the current batch look for their nearest neighbour. An image
holds up to K objects (the clusters found in both of its views); the bank stores K slots per
image with a flag for the slots that hold an object (the authors' queue stores a variable number
of objects per image and a count per image, which is the same set).

The caller enqueues the objects of the gathered global batch, so every rank holds the same bank;
the order inside a batch does not change any nearest neighbour (a set). The buffers are
persistent, so the bank travels with the checkpoint and resumes exactly. It starts empty.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class ObjectQueue(nn.Module):
    """Ring buffer of ``size`` images' objects: ``objects`` (size, 2, K, D), ``valid`` (size, K).

    Args:
        size: Images in the bank (CrIBo: 25,000); at least the global batch.
        slots: Objects per image K (the number of clusters).
        dim: Size of an object representation (the backbone's token width).
    """

    objects: Tensor
    valid: Tensor
    pointer: Tensor

    def __init__(self, size: int, slots: int, dim: int) -> None:
        super().__init__()
        if size < 1 or slots < 1 or dim < 1:
            raise ValueError(f"ObjectQueue needs size, slots and dim >= 1, got {size}, {slots}, "
                             f"{dim}.")
        self.register_buffer("objects", torch.zeros(size, 2, slots, dim))
        self.register_buffer("valid", torch.zeros(size, slots, dtype=torch.bool))
        self.register_buffer("pointer", torch.zeros((), dtype=torch.long))

    @property
    def size(self) -> int:
        return self.objects.shape[0]

    def bank(self) -> tuple[Tensor, Tensor, Tensor]:
        """Copies of the stored objects of view 1 and of view 2, (size · K, D) each, and their
        flags (size · K,)."""
        objects = self.objects.flatten(0, 2).unflatten(0, (self.size, 2, -1))
        return (objects[:, 0].flatten(0, 1).clone(), objects[:, 1].flatten(0, 1).clone(),
                self.valid.flatten().clone())

    @torch.no_grad()
    def enqueue(self, objects: Tensor, valid: Tensor) -> None:
        """Overwrite the oldest ``len(objects)`` images with ``objects`` (G, 2, K, D) and their
        flags ``valid`` (G, K).

        Raises:
            ValueError: the shapes do not fit, or the batch has more images than the bank.
        """
        if objects.shape[1:] != self.objects.shape[1:] or valid.shape != objects.shape[:1] + \
                self.valid.shape[1:]:
            raise ValueError(f"Objects {tuple(objects.shape)} with flags {tuple(valid.shape)} do "
                             f"not fit a bank of {tuple(self.objects.shape)}.")
        count = objects.shape[0]
        if count > self.size:
            raise ValueError(f"The object bank holds {self.size} images but a step enqueues "
                             f"{count} (the global batch); raise queue_size to at least {count}.")
        rows = (int(self.pointer) + torch.arange(count, device=self.objects.device)) % self.size
        self.objects[rows] = objects.detach().to(self.objects.dtype)
        self.valid[rows] = valid.to(self.objects.device)
        self.pointer.fill_((int(self.pointer) + count) % self.size)

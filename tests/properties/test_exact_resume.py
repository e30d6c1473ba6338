"""Property of every registered method: a run resumed inside an epoch is bit-exact.

For each method of the registry (:func:`ssl_lightning.methods.registry.method_entries`), its
small instance trains 2 epochs of 2 batches of 4 (4 optimizer steps, float64, a warm-up and
cosine schedule) through the Trainer on ready views of its crop sizes, through the package's
resumable loader (:class:`~ssl_lightning.testing.ViewsDataModule`: shuffled per epoch, batches
with sample seeds), saving a checkpoint after every step. Fresh instances resumed with
``Trainer.fit(ckpt_path=...)`` after step 1 (inside epoch 0: the resumed run crosses into epoch
1) and after step 3 (inside epoch 1) end equal, by ``torch.equal``, to the uninterrupted run:
weights and buffers (queues and their pointers, centres, EMA teachers, banks, groups),
optimiser and scheduler states, callback states and step
(:func:`ssl_lightning.testing.assert_resume_is_exact`, which both resumes share one
uninterrupted run of). A method that opts out of ``exact_resume`` is skipped with its reason
printed.

What the property does not cover stays in ``tests/resume/``: real image folders with random
augmentations and loader workers, SIGTERM, DDP and sharded (streaming) resumes, a changed
world size, BatchNorm heads and stochastic depth of tuned instances.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from opt_outs import skip_opted_out

from ssl_lightning.data import SimCLRViews
from ssl_lightning.methods.registry import MethodEntry, method_entries
from ssl_lightning.testing import PrecomputedViews, ViewsDataModule, assert_resume_is_exact

ENTRIES = method_entries()
#: A warm-up of one step (half an epoch of 2 steps), then cosine: the schedule's position is
#: part of what a resume restores.
OPTIM = dict(optimizer="sgd", lr=0.1, lr_scaling="none", warmup_epochs=0.5)

#: Tiny tensors: one intra-op thread is faster (and fair to a shared machine).
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("entry", ENTRIES, ids=[e.name for e in ENTRIES])
def test_resume_inside_an_epoch_is_bit_exact(entry: MethodEntry, tmp_path: Path) -> None:
    skip_opted_out(entry, "exact_resume")
    assert_resume_is_exact(lambda: entry.small(**OPTIM), _data(entry), str(tmp_path), epochs=2,
                           stop_steps=(1, 3))


def _data(entry: MethodEntry) -> ViewsDataModule:
    """8 ready views of the entry's crop sizes, batches of 4; the transform the data module
    names says how many of them are weak (ReSSL checks it against its ``weak_views``)."""
    weak = getattr(entry.small(), "weak_views", 0)
    kind = SimCLRViews("cifar", num_views=len(entry.views) - weak, crop_size=entry.views[0],
                       weak_views=weak)
    return ViewsDataModule(PrecomputedViews(8, entry.views), batch_size=4, train_transform=kind)

"""The losses are public names of ``ssl_lightning`` itself, beside the methods, callbacks, data
modules and evaluation classes, with no name exported twice."""

from __future__ import annotations

import ssl_lightning
import ssl_lightning.losses as losses


def test_losses_import_from_the_top_level() -> None:
    from ssl_lightning import DINOLoss, NTXentLoss, sinkhorn_knopp

    assert NTXentLoss is losses.NTXentLoss and DINOLoss is losses.DINOLoss
    assert sinkhorn_knopp is losses.sinkhorn_knopp
    for name in losses.__all__:
        assert getattr(ssl_lightning, name) is getattr(losses, name), name
    assert set(losses.__all__) <= set(ssl_lightning.__all__)


def test_no_public_name_is_exported_twice() -> None:
    assert len(ssl_lightning.__all__) == len(set(ssl_lightning.__all__))

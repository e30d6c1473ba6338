"""NNCLR (Dwibedi et al., ICCV 2021) as a method: an empty support set is refused in
``__init__``, naming the argument."""

from __future__ import annotations

import pytest

from ssl_lightning.backbones import SmallConvNet
from ssl_lightning.methods import NNCLR


def test_an_empty_support_set_is_refused() -> None:
    with pytest.raises(ValueError, match=r"queue_size \(the support set\) must be"):
        NNCLR(SmallConvNet((8,)), queue_size=0)

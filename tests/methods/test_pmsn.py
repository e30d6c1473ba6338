"""PMSN (Assran et al., ICLR 2023): MSN with a power-law prior on the mean prediction; the prior
enters the loss (exponent 0 is MSN's), and a negative exponent is refused in ``__init__``."""

from __future__ import annotations

import pytest
import torch
from multicrop_utils import msn_views, small_msn

from ssl_lightning.methods import PMSN


def test_pmsn_prior_enters_the_loss() -> None:
    out = small_msn().forward_views(msn_views())
    msn = small_msn().loss_from_outputs(out)
    pmsn = small_msn(PMSN).loss_from_outputs(out)
    same_prior = small_msn(PMSN, power_law_exponent=0.0).loss_from_outputs(out)
    assert torch.equal(msn, same_prior) and not torch.allclose(msn, pmsn)


def test_bad_settings_fail_in_init() -> None:
    with pytest.raises(ValueError, match="power_law_exponent must be >= 0"):
        small_msn(PMSN, power_law_exponent=-1.0)

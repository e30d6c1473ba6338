"""The command line hides the known third-party deprecation warnings (ssl_lightning/cli/quiet.py)
and nothing else; ``-W`` / ``PYTHONWARNINGS`` keep everything."""

from __future__ import annotations

import sys
import warnings
from importlib import import_module

import pytest

from ssl_lightning._lightning import PACKAGE
from ssl_lightning.cli import quiet


def _raised(monkeypatch: pytest.MonkeyPatch, warnoptions: list[str]) -> list[str]:
    """Messages of the warnings the real library calls raise after quiet_known_warnings."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    monkeypatch.setattr(sys, "warnoptions", warnoptions)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet.quiet_known_warnings()
        StatefulDataLoader([1, 2])
        import_module(f"{PACKAGE}.utilities._pytree")._tree_flatten(1)
        fabric = "lightning_fabric" if PACKAGE == "pytorch_lightning" else "lightning.fabric"
        warnings.warn_explicit(  # as torch attributes it (stacklevel 3: Lightning's caller)
            "torch.distributed.nn.functional.all_gather is deprecated, use "
            "torch.distributed._functional_collectives.all_gather_tensor instead.",
            FutureWarning, "distributed.py", 243, module=f"{fabric}.utilities.distributed")
        warnings.warn("our own warning", UserWarning, stacklevel=1)
    return [str(w.message) for w in caught]


def test_known_third_party_warnings_are_hidden_and_others_kept(monkeypatch) -> None:
    assert _raised(monkeypatch, []) == ["our own warning"]


def test_asking_for_warnings_keeps_them_all(monkeypatch) -> None:
    messages = _raised(monkeypatch, ["default"])
    assert any("set_vital" in m for m in messages) and any("LeafSpec" in m for m in messages)
    assert any("all_gather is deprecated" in m for m in messages)
    assert "our own warning" in messages


def test_every_filter_says_why() -> None:
    assert all(len(why) > 40 for *_, why in quiet.KNOWN_WARNINGS)

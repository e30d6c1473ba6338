"""The one way a property test skips a method: the method's registered opt-out, printed."""

from __future__ import annotations

import pytest

from ssl_lightning.methods.registry import MethodEntry


def skip_opted_out(entry: MethodEntry, prop: str) -> None:
    """Skip, printing the registry's reason, when ``entry`` opts out of ``prop``."""
    reason = entry.opt_out(prop)
    if reason is not None:
        print(f"{entry.name} opts out of {prop}: {reason}")
        pytest.skip(f"{entry.name} opts out of {prop}: {reason}")

"""Re-export of :mod:`ssl_lightning.masking.block` (import from there)."""

from ssl_lightning.masking.block import *  # noqa: F401,F403

"""Re-export of :mod:`ssl_lightning.backbones.multicrop` (import from there)."""

from ssl_lightning.backbones.multicrop import *  # noqa: F401,F403

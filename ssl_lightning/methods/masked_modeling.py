"""Re-export of :mod:`ssl_lightning.backbones.tokens` (import from there)."""

from ssl_lightning.backbones.tokens import *  # noqa: F401,F403

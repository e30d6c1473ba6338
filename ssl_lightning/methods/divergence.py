"""Re-export of :mod:`ssl_lightning.training.divergence` (import from there)."""

from ssl_lightning.training.divergence import *  # noqa: F401,F403

"""Re-export of :mod:`ssl_lightning.masking` (import from there)."""

from ssl_lightning.masking import *  # noqa: F401,F403

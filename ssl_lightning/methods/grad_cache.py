"""Re-export of :mod:`ssl_lightning.training.grad_cache` (import from there)."""

from ssl_lightning.training.grad_cache import *  # noqa: F401,F403

"""Re-export of :mod:`ssl_lightning.training.step_rng` (import from there)."""

from ssl_lightning.training.step_rng import *  # noqa: F401,F403

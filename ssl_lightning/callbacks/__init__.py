"""Training callbacks: EMA teacher updates and evaluation (kNN, online linear probe)."""

from ssl_lightning.callbacks.collapse import CollapseMonitor
from ssl_lightning.callbacks.ema import EMACallback

__all__: list[str] = ["CollapseMonitor", "EMACallback"]

"""Training callbacks: EMA teacher updates and evaluation (kNN, online linear probe)."""

from ssl_lightning.callbacks.collapse import CollapseMonitor
from ssl_lightning.callbacks.ema import EMACallback
from ssl_lightning.callbacks.knn import KNNCallback, knn_predict
from ssl_lightning.callbacks.online_probe import OnlineProbe
from ssl_lightning.callbacks.preemption import PreemptionCheckpoint

__all__: list[str] = [
    "CollapseMonitor", "EMACallback", "KNNCallback", "OnlineProbe", "knn_predict",
    "PreemptionCheckpoint",
]

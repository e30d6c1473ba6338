"""Training callbacks: EMA teacher updates, evaluation (kNN, online linear probe), checkpoints
on preemption, the console summary of a run and the capture of a diverged step."""

from ssl_lightning.callbacks.collapse import CollapseMonitor
from ssl_lightning.callbacks.divergence_capture import DivergenceCapture
from ssl_lightning.callbacks.ema import EMACallback
from ssl_lightning.callbacks.knn import KNNCallback, knn_predict
from ssl_lightning.callbacks.online_probe import OnlineProbe
from ssl_lightning.callbacks.preemption import PreemptionCheckpoint
from ssl_lightning.callbacks.run_summary import RunSummary

__all__: list[str] = [
    "CollapseMonitor", "DivergenceCapture", "EMACallback", "KNNCallback", "OnlineProbe",
    "knn_predict", "PreemptionCheckpoint", "RunSummary",
]

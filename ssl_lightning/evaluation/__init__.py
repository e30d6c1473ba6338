"""Evaluation of pre-trained backbones: linear eval (probe grids), kNN eval, few-shot,
attentive probes, export (also at the end of fit), embedding pictures.

The export command lives in :mod:`ssl_lightning.evaluation.export` (not imported here, so that
``python -m ssl_lightning.evaluation.export`` runs it cleanly).
"""

from ssl_lightning.evaluation.attentive import AttentiveEval
from ssl_lightning.evaluation.checkpoint import backbone_state_dict, load_backbone
from ssl_lightning.evaluation.embedding_plot import EmbeddingPlot
from ssl_lightning.evaluation.export_callback import ExportBackbone
from ssl_lightning.evaluation.fewshot import FewShotEval
from ssl_lightning.evaluation.knn_eval import KNNEval
from ssl_lightning.evaluation.linear import LinearEval
from ssl_lightning.evaluation.projection import pca_2d, project_2d

__all__ = [
    "AttentiveEval",
    "EmbeddingPlot",
    "ExportBackbone",
    "FewShotEval",
    "KNNEval",
    "LinearEval",
    "backbone_state_dict",
    "load_backbone",
    "pca_2d",
    "project_2d",
]

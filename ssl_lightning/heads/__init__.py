"""Heads: MLP projection/prediction heads, the DINO head, SwAV's prototypes and the MAE decoder /
I-JEPA predictor, in one place."""

from ssl_lightning.heads.masked_predictor import MaskedPredictor
from ssl_lightning.heads.mlp import PredictionHead, ProjectionHead, build_mlp
from ssl_lightning.heads.prototypes import DINOHead, SwAVPrototypes

__all__ = ["DINOHead", "MaskedPredictor", "PredictionHead", "ProjectionHead", "SwAVPrototypes",
           "build_mlp"]

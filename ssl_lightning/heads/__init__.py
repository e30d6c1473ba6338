"""Heads: MLP projection/prediction heads, the DINO head, SwAV's prototypes, the MAE decoder /
I-JEPA predictor and IterNorm (VIbCReg's whitening), in one place."""

from ssl_lightning.heads.iternorm import IterNorm
from ssl_lightning.heads.masked_predictor import MaskedPredictor
from ssl_lightning.heads.mlp import PredictionHead, ProjectionHead, build_mlp
from ssl_lightning.heads.prototypes import DINOHead, SwAVPrototypes

__all__ = ["DINOHead", "IterNorm", "MaskedPredictor", "PredictionHead", "ProjectionHead",
           "SwAVPrototypes", "build_mlp"]

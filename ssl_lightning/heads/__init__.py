"""Heads: MLP projection/prediction heads, the DINO head, SwAV's prototypes, the MAE decoder /
I-JEPA predictor, CAPI's cross-attention predictor and L2-normalised heads, IterNorm
(VIbCReg's whitening), All4One's neighbour transformer and the attentive probe's pooling, in
one place."""

from ssl_lightning.heads.attentive_pooling import AttentivePooling
from ssl_lightning.heads.cross_attention_predictor import CrossAttentionPredictor
from ssl_lightning.heads.iternorm import IterNorm
from ssl_lightning.heads.masked_predictor import MaskedPredictor
from ssl_lightning.heads.mlp import PredictionHead, ProjectionHead, build_mlp
from ssl_lightning.heads.neighbour_transformer import NeighbourTransformer
from ssl_lightning.heads.prototypes import (
    DINOHead,
    L2NormLinear,
    ObjectDINOHead,
    SwAVPrototypes,
)

__all__ = ["AttentivePooling", "CrossAttentionPredictor", "DINOHead", "IterNorm", "L2NormLinear",
           "MaskedPredictor", "NeighbourTransformer", "ObjectDINOHead", "PredictionHead",
           "ProjectionHead", "SwAVPrototypes", "build_mlp"]

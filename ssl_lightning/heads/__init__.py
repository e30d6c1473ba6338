"""Heads: MLP projection/prediction heads, the DINO head and SwAV's prototypes, in one place."""

from ssl_lightning.heads.mlp import PredictionHead, ProjectionHead, build_mlp
from ssl_lightning.heads.prototypes import DINOHead, SwAVPrototypes

__all__ = ["DINOHead", "PredictionHead", "ProjectionHead", "SwAVPrototypes", "build_mlp"]

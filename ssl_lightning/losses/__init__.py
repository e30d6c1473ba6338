"""Pure loss modules: embeddings in, scalar out. A loss never reads the trainer."""

from ssl_lightning.losses.aim import AIMLoss
from ssl_lightning.losses.all4one import All4OneLoss, FeatureRedundancyLoss
from ssl_lightning.losses.barlow_twins import BarlowTwinsLoss
from ssl_lightning.losses.byol import BYOLLoss
from ssl_lightning.losses.capi import CAPILoss
from ssl_lightning.losses.cribo import CrIBoLoss
from ssl_lightning.losses.dcl import DCLLoss
from ssl_lightning.losses.deepcluster import DeepClusterLoss
from ssl_lightning.losses.densecl import DenseCLLoss
from ssl_lightning.losses.detcon import DetConLoss
from ssl_lightning.losses.dino import DINOLoss
from ssl_lightning.losses.distillation import (
    DistillationLoss,
    PatchSimilarityDistillationLoss,
    QueueDistillationLoss,
)
from ssl_lightning.losses.fastsiam import FastSiamLoss
from ssl_lightning.losses.gram import GramLoss
from ssl_lightning.losses.ibot_patch import IBOTPatchLoss
from ssl_lightning.losses.ijepa import IJEPALoss
from ssl_lightning.losses.infonce import InfoNCELoss
from ssl_lightning.losses.koleo import KoLeoLoss
from ssl_lightning.losses.lejepa import LeJEPALoss
from ssl_lightning.losses.mae import MAELoss
from ssl_lightning.losses.mmcr import MMCRLoss
from ssl_lightning.losses.moco_v3 import MoCoV3Loss
from ssl_lightning.losses.msn import MSNLoss
from ssl_lightning.losses.neco import NeCoLoss
from ssl_lightning.losses.negative_cosine import NegativeCosineLoss
from ssl_lightning.losses.nnclr import NNCLRLoss
from ssl_lightning.losses.nt_xent import NTXentLoss
from ssl_lightning.losses.pixpro import PixProLoss
from ssl_lightning.losses.ressl import ReSSLLoss
from ssl_lightning.losses.sigreg import SIGRegLoss
from ssl_lightning.losses.simmim import SimMIMLoss
from ssl_lightning.losses.sinkhorn import sinkhorn_knopp
from ssl_lightning.losses.supcon import SupConLoss
from ssl_lightning.losses.swav import SwAVLoss
from ssl_lightning.losses.tico import TiCoLoss
from ssl_lightning.losses.vibcreg import VIbCRegLoss
from ssl_lightning.losses.vicreg import VICRegLoss
from ssl_lightning.losses.vicregl import VICRegLLoss
from ssl_lightning.losses.wmse import WMSELoss

__all__ = ["DINOLoss", "SwAVLoss", "sinkhorn_knopp", "NTXentLoss",
           "BarlowTwinsLoss", "NegativeCosineLoss", "VICRegLoss",
           "InfoNCELoss", "MoCoV3Loss", "BYOLLoss", "MAELoss", "IJEPALoss", "DCLLoss",
           "NNCLRLoss", "SupConLoss", "IBOTPatchLoss", "KoLeoLoss",
           "FastSiamLoss", "SIGRegLoss", "LeJEPALoss", "TiCoLoss", "MMCRLoss", "WMSELoss",
           "VIbCRegLoss", "GramLoss", "DistillationLoss", "QueueDistillationLoss",
           "PatchSimilarityDistillationLoss", "SimMIMLoss", "AIMLoss", "MSNLoss",
           "ReSSLLoss", "All4OneLoss", "FeatureRedundancyLoss", "DeepClusterLoss",
           "DenseCLLoss", "VICRegLLoss", "CAPILoss", "DetConLoss",
           "NeCoLoss", "PixProLoss", "CrIBoLoss"]

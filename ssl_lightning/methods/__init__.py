"""Self-supervised methods, each a LightningModule derived from SSLMethod.

Each method file registers its class (:func:`~ssl_lightning.methods.registry.register_method`)
when imported here; ``tests/methods/test_registry.py`` checks that ``__all__`` is the two base
classes and exactly the registered methods.
"""

from ssl_lightning.methods.aim import AIM
from ssl_lightning.methods.all4one import All4One
from ssl_lightning.methods.barlow_twins import BarlowTwins
from ssl_lightning.methods.base import SSLMethod
from ssl_lightning.methods.byol import BYOL
from ssl_lightning.methods.capi import CAPI
from ssl_lightning.methods.cribo import CrIBo
from ssl_lightning.methods.dcl import DCL
from ssl_lightning.methods.deepcluster_v2 import DeepClusterV2
from ssl_lightning.methods.densecl import DenseCL
from ssl_lightning.methods.detcon_b import DetConB
from ssl_lightning.methods.detcon_s import DetConS
from ssl_lightning.methods.dino import DINO
from ssl_lightning.methods.dinov2 import DINOv2
from ssl_lightning.methods.dinov2_matryoshka import DINOv2Matryoshka
from ssl_lightning.methods.dinov2_paka import DINOv2PaKA
from ssl_lightning.methods.dinov3 import DINOv3
from ssl_lightning.methods.directclr import DirectCLR
from ssl_lightning.methods.distillation import Distillation
from ssl_lightning.methods.fastsiam import FastSiam
from ssl_lightning.methods.ibot import IBOT
from ssl_lightning.methods.ijepa import IJEPA
from ssl_lightning.methods.lejepa import LeJEPA
from ssl_lightning.methods.mae import MAE
from ssl_lightning.methods.mmcr import MMCR
from ssl_lightning.methods.moco_v2 import MoCoV2
from ssl_lightning.methods.moco_v2_plus import MoCoV2Plus
from ssl_lightning.methods.moco_v3 import MoCoV3
from ssl_lightning.methods.momentum import MomentumMethod
from ssl_lightning.methods.msn import MSN
from ssl_lightning.methods.neco import NeCo
from ssl_lightning.methods.nnbyol import NNBYOL
from ssl_lightning.methods.nnclr import NNCLR
from ssl_lightning.methods.nnsiam import NNSiam
from ssl_lightning.methods.pixio import Pixio
from ssl_lightning.methods.pixpro import PixPro
from ssl_lightning.methods.pmsn import PMSN
from ssl_lightning.methods.ressl import ReSSL
from ssl_lightning.methods.simclr import SimCLR
from ssl_lightning.methods.simmim import SimMIM
from ssl_lightning.methods.simsiam import SimSiam
from ssl_lightning.methods.smog import SMoG
from ssl_lightning.methods.supcon import SupCon
from ssl_lightning.methods.swav import SwAV
from ssl_lightning.methods.tico import TiCo
from ssl_lightning.methods.vibcreg import VIbCReg
from ssl_lightning.methods.vicreg import VICReg
from ssl_lightning.methods.vicregl import VICRegL
from ssl_lightning.methods.visreg import VISReg
from ssl_lightning.methods.wmse import WMSE

__all__ = ["SSLMethod", "SimCLR", "DINO", "SwAV", "BarlowTwins", "SimSiam", "VICReg",
           "MomentumMethod", "MoCoV2", "MoCoV3", "BYOL", "MAE", "IJEPA", "NNCLR", "DCL",
           "SupCon", "IBOT", "DINOv2", "DINOv3", "MoCoV2Plus", "FastSiam",
           "NNBYOL", "NNSiam", "DirectCLR", "LeJEPA",
           "TiCo", "MMCR", "WMSE", "VIbCReg", "Distillation", "SimMIM", "AIM", "MSN", "PMSN",
           "ReSSL", "All4One", "DeepClusterV2", "SMoG",
           "DenseCL", "VICRegL", "Pixio", "CAPI",
           "DINOv2Matryoshka", "DINOv2PaKA", "VISReg", "DetConS", "DetConB", "NeCo",
           "PixPro", "CrIBo"]

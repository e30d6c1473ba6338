"""Patch-mask generators of the masked-image methods, one class per scheme: drawn from torch's
CPU RNG, so a reseeded or replayed generator redraws the same masks.

- :class:`RandomMasking`: MAE's uniform masks; :class:`RandomUnitMasking`: SimMIM's masks of
  square units of patches (:mod:`.uniform`).
- :class:`MultiBlockMasking`: I-JEPA's target and context blocks (:mod:`.multi_block`).
- :class:`BlockMasking`: BEiT's blockwise masks of iBOT and DINOv2 (:mod:`.block`).
- :class:`InverseBlockMasking`: CAPI's masks, all but one rolled rectangle
  (:mod:`.inverse_block`).
"""

from ssl_lightning.masking.block import BlockMaskGenerator, BlockMasking
from ssl_lightning.masking.inverse_block import InverseBlockMasking
from ssl_lightning.masking.multi_block import MultiBlockMasking, Range
from ssl_lightning.masking.uniform import RandomMasking, RandomUnitMasking, random_masking

__all__ = ["BlockMaskGenerator", "BlockMasking", "InverseBlockMasking", "MultiBlockMasking",
           "RandomMasking", "Range", "RandomUnitMasking", "random_masking"]

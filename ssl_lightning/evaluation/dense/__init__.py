"""Dense probes of a frozen backbone's patch features (``forward_dense``): linear semantic
segmentation and linear depth (DINOv2/DINOv3's protocols) and dense kNN segmentation (the
Hummingbird protocol), also online during pre-training (``DenseKNNProbe``); data from
:mod:`ssl_lightning.data.dense_pairs`. See docs/evaluation.md.
"""

from ssl_lightning.evaluation.dense.depth_linear import DepthLinearProbe
from ssl_lightning.evaluation.dense.online import DenseKNNProbe
from ssl_lightning.evaluation.dense.seg_knn import DenseKNNSegmentation
from ssl_lightning.evaluation.dense.seg_linear import SegLinearProbe

__all__ = ["DenseKNNProbe", "DenseKNNSegmentation", "DepthLinearProbe", "SegLinearProbe"]

"""Drop-in replacements for torch.nn modules. Each subclasses the module it replaces and overrides only
``forward``; importing this package fills the converter's registry."""

from .activation import LeakyReLU, ReLU
from .batchnorm import BatchNorm1d, BatchNorm2d, BatchNorm3d
from .clamp import Hardsigmoid, Hardtanh, ReLU6, Threshold
from .conv import Conv1d, Conv2d, Conv3d, ConvTranspose1d, ConvTranspose2d, ConvTranspose3d
from .dropout import Dropout, Dropout1d, Dropout2d, Dropout3d
from .linear import Linear
from .norms import FusedAddRMSNorm, GroupNorm, LayerNorm, PolyNorm, RMSNorm
from .pooling import (
    AdaptiveAvgPool1d,
    AdaptiveAvgPool2d,
    AdaptiveAvgPool3d,
    AvgPool1d,
    AvgPool2d,
    AvgPool3d,
    MaxPool1d,
    MaxPool2d,
    MaxPool3d,
)

__all__ = [
    "AdaptiveAvgPool1d", "AdaptiveAvgPool2d", "AdaptiveAvgPool3d",
    "AvgPool1d", "AvgPool2d", "AvgPool3d",
    "BatchNorm1d", "BatchNorm2d", "BatchNorm3d",
    "Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d",
    "Dropout", "Dropout1d", "Dropout2d", "Dropout3d",
    "FusedAddRMSNorm", "GroupNorm", "LayerNorm", "PolyNorm", "RMSNorm",
    "LeakyReLU", "Linear", "ReLU", "Hardsigmoid", "Hardtanh", "ReLU6", "Threshold",
    "MaxPool1d", "MaxPool2d", "MaxPool3d",
]

"""Functional forms of slimgrad's layers: the same signatures as ``torch.nn.functional``."""

from ._transforms import func_policy, get_func_policy, set_func_policy
from .activation import leaky_relu, relu
from .batch_norm import batch_norm
from .clamp import hardsigmoid, hardtanh, hardtanh_, relu6, threshold, threshold_
from .clamped_swiglu import clamped_swiglu
from .conv import conv1d, conv2d, conv3d, conv_transpose1d, conv_transpose2d, conv_transpose3d
from .cross_entropy import fused_linear_cross_entropy
from .dropout import dropout, dropout1d, dropout2d, dropout3d
from .gated import gated_activation
from .hf_activations import gelu_new, gelu_python, quick_gelu
from .layer_norm_2d import layer_norm_2d, layer_norm_2d_formula
from .lora import LoraAdapter, lora_linear
from .norms import fused_add_rms_norm, group_norm, layer_norm, poly_norm, rms_norm, rms_norm_hf
from .pooling import (
    adaptive_avg_pool1d,
    adaptive_avg_pool2d,
    adaptive_avg_pool3d,
    avg_pool1d,
    avg_pool2d,
    avg_pool3d,
    max_pool1d,
    max_pool2d,
    max_pool3d,
)

__all__ = [
    "adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d",
    "avg_pool1d", "avg_pool2d", "avg_pool3d",
    "batch_norm",
    "clamped_swiglu",
    "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
    "dropout", "dropout1d", "dropout2d", "dropout3d",
    "fused_linear_cross_entropy",
    "func_policy", "get_func_policy", "set_func_policy",
    "gated_activation", "gelu_new", "gelu_python", "quick_gelu",
    "leaky_relu", "relu", "hardsigmoid", "hardtanh", "hardtanh_", "relu6", "threshold", "threshold_",
    "LoraAdapter", "lora_linear",
    "fused_add_rms_norm", "group_norm", "layer_norm", "layer_norm_2d", "layer_norm_2d_formula",
    "poly_norm", "rms_norm", "rms_norm_hf",
    "max_pool1d", "max_pool2d", "max_pool3d",
]

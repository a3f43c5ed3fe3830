"""Triton kernels for CUDA tensors (and CPU tensors under ``TRITON_INTERPRET=1``). Each family's module
registers its kernels here with ``registry.register(..., load=...)`` so triton is imported only when a
kernel first runs.

Priorities under ``SLIMGRAD_KERNELS=auto`` (CUDA): the Triton kernel wins where the torch path is a chain
of Python-level ops (Hugging Face RMSNorms, FusedAddRMSNorm, gated activations). Where the torch path is
one stock aten kernel that already skips unrequested gradients (``F.rms_norm`` on CUDA, layer norm), the
torch path has the higher priority: it is bitwise stock and no slower; ``SLIMGRAD_KERNELS=triton`` still
selects the Triton kernel there.
"""

import importlib

import torch

from slimgrad.kernels.registry import register

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _loader(name: str):
    return lambda: importlib.import_module(f"{__name__}.{name}")


register("rms_norm_hf", "triton", devices=("cuda",), dtypes=_DTYPES, load=_loader("rms_norm"), priority=10,
         note="RMSNorm, Hugging Face casting styles (llama, olmo2, gemma, t5)")
register("rms_norm", "triton", devices=("cuda",), dtypes=_DTYPES, load=_loader("rms_norm"), priority=-10,
         note="torch.rms_norm's casting; aten's fused CUDA kernel is preferred under auto")
register("fused_add_rms_norm", "triton", devices=("cuda",), dtypes=_DTYPES, load=_loader("rms_norm"), priority=10)
register("layer_norm", "triton", devices=("cuda",), dtypes=_DTYPES, load=_loader("layer_norm"), priority=-10,
         note="aten's native_layer_norm (bitwise stock, honours output_mask) is preferred under auto")
register("gated_activation", "triton", devices=("cuda",), dtypes=_DTYPES, load=_loader("gated"), priority=10)
register("max_pool_positions", "triton", devices=("cuda",), dtypes=_DTYPES + (torch.float64,),
         load=_loader("max_pool"), priority=10, note="1-d/2-d: output and window positions in one pass; 3-d: torch")
register("relu_mask", "triton", devices=("cuda",), dtypes=_DTYPES, load=_loader("relu_mask"), priority=10,
         note="output and packed mask in one kernel; gradient from the mask in one kernel")
register("dropout_seed", "triton", devices=("cuda",), dtypes=_DTYPES, load=_loader("dropout"), priority=10,
         note="Philox mask from a device-resident seed: no host sync, regenerated in backward")

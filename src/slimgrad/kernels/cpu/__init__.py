"""JIT-compiled CPU kernels (numba; compiled on first use and cached on disk, see ``_numba``). Each family's
module registers its kernels here with ``registry.register(..., load=...)`` so numba is imported only when
a kernel first runs. Priority 10: above the torch references (priority 0) under ``SLIMGRAD_KERNELS=auto``.
"""

from __future__ import annotations

import importlib

import torch

from .. import registry

_PRIORITY = 10
_ALL = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _loader(module: str, cls: str):
    def load():
        return getattr(importlib.import_module(f"{__name__}.{module}"), cls)()

    return load


registry.register("relu_mask", registry.NUMBA, devices=("cpu",), dtypes=_ALL, priority=_PRIORITY,
                  load=_loader("relu_mask", "NumbaReluMask"),
                  note="fused forward+pack, unpack+grad; leaky_relu bf16/fp16 delegate to torch")
registry.register("max_pool_positions", registry.NUMBA, devices=("cpu",), dtypes=(torch.float32, torch.float64),
                  priority=_PRIORITY, load=_loader("max_pool", "NumbaMaxPoolPositions"),
                  note="2-d: one-pass forward with positions, scatter backward; 1-d/3-d delegate to torch")
registry.register("dropout_bits", registry.NUMBA, devices=("cpu",), dtypes=(torch.float32, torch.float64),
                  priority=_PRIORITY, load=_loader("dropout", "NumbaDropoutBits"),
                  note="fused apply+pack, unpack+grad")
registry.register("range_mask", registry.NUMBA, devices=("cpu",), dtypes=_ALL, priority=_PRIORITY,
                  load=_loader("range_mask", "NumbaRangeMask"),
                  note="one-pass pack (fp32/fp64; fp16/bf16 delegate to torch), select on the integer view")

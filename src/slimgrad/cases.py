"""The fine-tuning cases of the MemSave evaluation, as ``requires_grad`` / train-eval settings.

- ``all``: every parameter trains; the input does not need a gradient.
- ``input``: every parameter frozen, the input needs a gradient (style transfer, adversarial examples).
- ``input-bn-eval``: as ``input`` with batch norms in eval mode (running statistics).
- ``norm``: only normalisation layers' parameters train.
- ``surgical``: only the first quarter of the parameterised layers (in definition order) trains; on a
  ResNet that is the stem and the first stage.
"""

from __future__ import annotations

import torch
from torch import nn

CASES = ("all", "input", "input-bn-eval", "norm", "surgical")

_NORMS = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)


def _leaf_layers_with_parameters(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if any(True for _ in m.parameters(recurse=False))]


def apply_case(model: nn.Module, case: str) -> bool:
    """Set ``requires_grad`` flags and train/eval modes on ``model`` for ``case``, in place.

    Returns whether the input should require grad in this case.
    """
    if case not in CASES:
        raise ValueError(f"unknown case {case!r}; cases: {', '.join(CASES)}")
    model.train()
    for p in model.parameters():
        p.requires_grad_(case == "all")
    if case == "input-bn-eval":
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.eval()
    elif case == "norm":
        for m in model.modules():
            if isinstance(m, _NORMS):
                for p in m.parameters(recurse=False):
                    p.requires_grad_(True)
    elif case == "surgical":
        layers = _leaf_layers_with_parameters(model)
        for m in layers[: max(1, len(layers) // 4)]:
            for p in m.parameters(recurse=False):
                p.requires_grad_(True)
    return case in ("input", "input-bn-eval")


def training_step(model: nn.Module, x: torch.Tensor, input_grad: bool) -> None:
    """One forward and backward of ``model(x).sum()``; gradients accumulate in ``.grad``."""
    x = x.detach().requires_grad_(input_grad)
    out = model(x)
    out.float().sum().backward()

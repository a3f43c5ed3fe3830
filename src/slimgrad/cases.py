"""The fine-tuning cases of the MemSave evaluation, as ``requires_grad`` / train-eval settings.

- ``all``: every parameter trains; the input does not need a gradient.
- ``input``: every parameter frozen, the input needs a gradient (style transfer, adversarial examples).
- ``input-bn-eval``: as ``input`` with batch norms in eval mode (running statistics).
- ``norm``: only normalisation layers' own parameters train (see :func:`is_norm`).
- ``surgical``: only the first quarter of the parameterised layers (in definition order) trains; on a
  ResNet that is the stem and the first stage.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from ._registry import ORIGINALS

CASES = ("all", "input", "input-bn-eval", "norm", "surgical")

_TORCH_NORMS = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.LocalResponseNorm)
#: class names of normalisation layers in other libraries: LlamaRMSNorm, T5LayerNorm, ConvNextLayerNorm,
#: diffusers' RMSNorm and GroupNorm, slimgrad's FusedAddRMSNorm and PolyNorm, BatchNorm2d-like names
_NORM_NAME = re.compile(r"Norm(\d?d)?$")


def is_norm(module: nn.Module) -> bool:
    """Whether ``module`` is a normalisation layer: a torch norm (or a subclass, such as transformers'
    ``ConvNextLayerNorm``), or a class of any library whose name ends in ``Norm`` (every Hugging Face
    RMSNorm, ``T5LayerNorm``, diffusers' norms). Matched by name because these libraries share no base class;
    a name ending in ``Norm`` is their convention."""
    kind = ORIGINALS.get(type(module), type(module))
    if isinstance(module, _TORCH_NORMS):
        return True
    return any(_NORM_NAME.search(k.__name__) for k in kind.__mro__ if k not in (nn.Module, object))


def _leaf_layers_with_parameters(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if any(True for _ in m.parameters(recurse=False))]


def apply_case(model: nn.Module, case: str) -> bool:
    """Set ``requires_grad`` flags and train/eval modes on ``model`` for ``case``, in place.

    Returns whether the input should require grad in this case. Raises ValueError when the case would train
    nothing and need no input gradient (``norm`` on a model without normalisation layers with parameters).
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
        norms = [m for m in model.modules() if is_norm(m) and any(True for _ in m.parameters(recurse=False))]
        if not norms:
            raise ValueError("case 'norm' found no normalisation layer with parameters in this model (looked "
                             "for torch norms and classes named '...Norm')")
        for m in norms:
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

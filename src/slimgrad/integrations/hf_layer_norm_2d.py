"""Channels-first LayerNorms of transformers' vision models (ConvNeXt, ConvNeXtV2, DINOv3-ConvNeXt, SAM
and its descendants, EoMT, ...), converted to :func:`slimgrad.functional.layer_norm_2d.layer_norm_2d`.

They subclass ``nn.LayerNorm`` but override ``forward`` (a permute around ``super().forward`` or around
``F.layer_norm``), so the converter's exact-type rule leaves them alone. As for the Hugging Face RMSNorms
(:mod:`slimgrad.integrations.hf_norms`), a class is converted only when its ``forward`` source is one read
here (compared as syntax trees, docstrings and argument names aside) and its base is the one that source
needs (``nn.LayerNorm``, or ``nn.Module`` for the Python formula); a name only narrows the search; a
forward changed after verification runs as stock. Matched today in transformers 5.23: 20
``ConvNextLayerNorm`` copies, 3 ``LayerNorm2d`` copies, and ``VitDetLayerNorm`` (the mean and variance
written out in Python, as SAM's and detectron2's ``LayerNorm2d``: :func:`register_class` takes a model's
own copy).
"""

from __future__ import annotations

import ast
import inspect
import textwrap

from torch import nn

from slimgrad._registry import ORIGINALS, REPLACEMENTS, register_forward
from slimgrad.functional.layer_norm_2d import layer_norm_2d, layer_norm_2d_formula
from slimgrad.functional.norms import layer_norm
from slimgrad.integrations._hf_classes import loaded_transformers_classes

__all__ = ["REFERENCE_FORWARDS", "register_class", "register_loaded"]

_CONVNEXT = '''
def forward(self, x):
    if self.data_format == "channels_first":
        x = x.permute(0, 2, 3, 1)
        x = super().forward(x)
        x = x.permute(0, 3, 1, 2)
    else:
        x = super().forward(x)
    return x
'''
_LAYERNORM2D = '''
def forward(self, x):
    x = x.permute(0, 2, 3, 1)
    x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
    x = x.permute(0, 3, 1, 2)
    return x
'''
_FORMULA = '''
def forward(self, x):
    u = x.mean(1, keepdim=True)
    s = (x - u).pow(2).mean(1, keepdim=True)
    x = (x - u) / torch.sqrt(s + self.eps)
    x = self.weight[:, None, None] * x + self.bias[:, None, None]
    return x
'''
#: kind -> the forward source it stands for (argument named ``x``)
REFERENCE_FORWARDS = {"convnext": _CONVNEXT, "layernorm2d": _LAYERNORM2D, "formula": _FORMULA}


def _canonical(source: str) -> str | None:
    """The body of a ``def forward(self, arg)`` as a syntax-tree dump, docstring dropped, ``arg`` renamed
    ``x``; None for any other shape of function."""
    try:
        node = ast.parse(textwrap.dedent(source)).body[0]
    except (SyntaxError, IndexError):
        return None
    if not isinstance(node, ast.FunctionDef):
        return None
    a = node.args
    if a.posonlyargs or a.vararg or a.kwonlyargs or a.kwarg or a.defaults or len(a.args) != 2:
        return None
    name = a.args[1].arg

    class Rename(ast.NodeTransformer):
        def visit_Name(self, n):
            return ast.copy_location(ast.Name(id="x", ctx=n.ctx), n) if n.id == name else n

    body = [s for s in node.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    return "\n".join(ast.dump(Rename().visit(s)) for s in body)


_REFERENCE = {_canonical(src): kind for kind, src in REFERENCE_FORWARDS.items()}
_VERIFIED: dict[type, object] = {}  # stock class -> its forward as verified
_KIND: dict[type, str] = {}
_checked: set[type] = set()


def _kind_of(cls: type) -> str | None:
    if "forward" not in cls.__dict__:
        return None
    try:
        kind = _REFERENCE.get(_canonical(inspect.getsource(cls.forward)))
    except (OSError, TypeError):
        return None
    # the permute forms call nn.LayerNorm's forward or read its attributes; the formula stands alone
    if kind in ("convnext", "layernorm2d") and cls.__bases__ != (nn.LayerNorm,):
        return None
    if kind == "formula" and cls.__bases__ != (nn.Module,):
        return None
    return kind


def _forward(self, x):
    stock = ORIGINALS[type(self)]
    if _VERIFIED.get(stock) is not stock.forward:
        return _VERIFIED[stock](self, x)
    if _KIND[stock] == "formula":
        return layer_norm_2d_formula(x, self.weight, self.bias, self.eps)
    if _KIND[stock] == "layernorm2d" or self.data_format == "channels_first":
        return layer_norm_2d(x, self.normalized_shape, self.weight, self.bias, self.eps)
    return layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


def _unsupported_reason(module: nn.Module) -> str | None:
    stock = type(module)
    if _VERIFIED.get(stock) is not stock.forward:
        return f"{stock.__name__}.forward was changed after slimgrad verified its source; left as stock"
    if _KIND[stock] == "convnext" and getattr(module, "data_format", None) not in ("channels_first", "channels_last"):
        return f"data_format is {getattr(module, 'data_format', None)!r}; left as stock"
    if _KIND[stock] == "formula":
        w, b = getattr(module, "weight", None), getattr(module, "bias", None)
        if not (isinstance(w, nn.Parameter) and isinstance(b, nn.Parameter) and w.dim() == 1 and b.shape == w.shape):
            return "weight and bias are not 1-d parameters of one shape; left as stock"
    return None


def register_loaded() -> list[type]:
    """Register every channels-first LayerNorm of the transformers modeling modules imported so far whose
    forward matches a reference; returns the classes newly registered. Cheap to call again."""
    added = []
    for name, cls in loaded_transformers_classes():
        # the name only narrows the search (as for the RMSNorms); the source decides
        if cls in _checked or not (issubclass(cls, nn.LayerNorm) or "Norm" in name):
            continue
        _checked.add(cls)
        if register_class(cls):
            added.append(cls)
    return added


def register_class(cls: type) -> bool:
    """Register ``cls`` (a model's own channels-first LayerNorm, e.g. SAM's ``LayerNorm2d``) when its
    forward is one of :data:`REFERENCE_FORWARDS`; returns whether it was registered now."""
    kind = _kind_of(cls)
    if kind is None or cls in REPLACEMENTS:
        return False
    _VERIFIED[cls] = cls.forward
    _KIND[cls] = kind
    register_forward(cls, _forward, module=__name__, unsupported_reason=_unsupported_reason)
    return True


register_loaded()
refresh = register_loaded  # called by slimgrad.integrations.load_available on every convert

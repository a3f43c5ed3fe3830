"""Channels-first LayerNorms of transformers' vision models (ConvNeXt, ConvNeXtV2, DINOv3-ConvNeXt, SAM
and its descendants, EoMT, ...), converted to :func:`slimgrad.functional.layer_norm_2d.layer_norm_2d`.

They subclass ``nn.LayerNorm`` but override ``forward`` (a permute around ``super().forward`` or around
``F.layer_norm``), so the converter's exact-type rule leaves them alone. As for the Hugging Face RMSNorms
(:mod:`slimgrad.integrations.hf_norms`), a class is converted only when its ``forward`` source is one read
here (compared by fingerprint, :mod:`slimgrad.integrations._fingerprint`: annotations, comments, layout,
argument names aside) and its base is the one that source
needs (``nn.LayerNorm``, or ``nn.Module`` for the Python formula); a name only narrows the search; a
forward changed after verification runs as stock. Matched in transformers 5.23 and 5.24: 20
``ConvNextLayerNorm`` copies, 3 ``LayerNorm2d`` copies, and ``VitDetLayerNorm`` (the mean and variance
written out in Python, as SAM's and detectron2's ``LayerNorm2d``: :func:`register_class` takes a model's
own copy). An ``nn.LayerNorm`` subclass whose forward is not one of these is recorded as a gap (family
"LayerNorm") with the reason, so ``convert`` says it is left to transformers.
"""

from __future__ import annotations

from torch import nn

from slimgrad import _notices
from slimgrad._registry import ORIGINALS, REPLACEMENTS, register_forward
from slimgrad.functional.layer_norm_2d import layer_norm_2d, layer_norm_2d_formula
from slimgrad.functional.norms import layer_norm
from slimgrad.integrations._fingerprint import fingerprint, names_read, source_fingerprint
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


_REFERENCE = {source_fingerprint(src): kind for kind, src in REFERENCE_FORWARDS.items()}
#: the names each reference reads: a class reading others cannot match (no need to fingerprint it)
_REFERENCE_NAMES = {names_read(src) for src in REFERENCE_FORWARDS.values()}
_VERIFIED: dict[type, object] = {}  # stock class -> its forward as verified
_KIND: dict[type, str] = {}
_checked: set[type] = set()


def _check(cls: type) -> tuple[str | None, str | None]:
    """(kind, None) for a forward slimgrad reproduces on the right base; (None, reason) for an
    ``nn.LayerNorm`` subclass (or a ``*LayerNorm2d``) whose forward it does not; (None, None) otherwise."""
    if "forward" not in cls.__dict__:
        return None, None
    layer_norm = issubclass(cls, nn.LayerNorm) or "LayerNorm2d" in cls.__name__
    if not layer_norm and names_read(cls.forward) not in _REFERENCE_NAMES:
        return None, None
    fp = fingerprint(cls.forward)
    kind = _REFERENCE.get(fp)
    # the permute forms call nn.LayerNorm's forward or read its attributes; the formula stands alone
    base = {"convnext": (nn.LayerNorm,), "layernorm2d": (nn.LayerNorm,), "formula": (nn.Module,)}.get(kind)
    if kind is not None and cls.__bases__ == base:
        return kind, None
    if not layer_norm:
        return None, None
    if kind is not None:
        return None, f"{cls.__name__}.forward is the {kind} one, but its base is not {base[0].__name__}"
    return None, (f"{cls.__name__}.forward (fingerprint {fp}) is not a channels-first LayerNorm forward "
                  f"slimgrad reproduces")


def _kind_of(cls: type) -> str | None:
    return _check(cls)[0]


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
    if cls in REPLACEMENTS:
        return False
    kind, reason = _check(cls)
    if kind is None:
        if reason is not None:
            _notices.record_class_gap(cls, library="transformers", family="LayerNorm", reason=reason)
        return False
    _VERIFIED[cls] = cls.forward
    _KIND[cls] = kind
    register_forward(cls, _forward, module=__name__, unsupported_reason=_unsupported_reason)
    return True


register_loaded()
refresh = register_loaded  # called by slimgrad.integrations.load_available on every convert

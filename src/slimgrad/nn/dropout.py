"""Drop-in Dropout modules keeping 1 bit per element or an 8-byte seed for backward instead of the float
mask (the dropout policy: see :mod:`slimgrad.functional.dropout`).

``Dropout.forward`` in training mode on an eager CPU tensor calls the compiled core directly (one C++ autograd
Function call; see :mod:`slimgrad.functional.dropout`); ``p`` is turned into a float once and cached in the
module's ``__dict__``. Everything else goes through :func:`slimgrad.functional.dropout.dropout`."""

from __future__ import annotations

import torch
from torch import nn

from slimgrad._registry import register
from slimgrad.functional.dropout import POLICY_ATTRIBUTE as _POLICY
from slimgrad.functional.dropout import _core, dropout, dropout1d, dropout2d, dropout3d

__all__ = ["Dropout", "Dropout1d", "Dropout2d", "Dropout3d"]


@register(nn.Dropout)
class Dropout(nn.Dropout):
    def forward(self, input):
        # convert(model, dropout=...) sets the policy per module; otherwise the process-wide one.
        state = self.__dict__
        if self.training:
            p = self.p
            cached = state.get("_slimgrad_core_p")
            if cached is None or cached[0] is not p:  # p, as a float once (a user may assign an int, 0.5, ...)
                cached = (p, float(p) if isinstance(p, (int, float)) else None)
                if not torch.compiler.is_compiling():  # dynamo refuses a state write inside a checkpoint's body
                    state["_slimgrad_core_p"] = cached
            if cached[1] is not None and (core := _core(input, cached[1], state.get(_POLICY))) is not None:
                return core.dropout_apply(input, cached[1], self.inplace)
        return dropout(input, self.p, self.training, self.inplace, policy=state.get(_POLICY))


@register(nn.Dropout1d)
class Dropout1d(nn.Dropout1d):
    def forward(self, input):
        return dropout1d(input, self.p, self.training, self.inplace)


@register(nn.Dropout2d)
class Dropout2d(nn.Dropout2d):
    def forward(self, input):
        return dropout2d(input, self.p, self.training, self.inplace)


@register(nn.Dropout3d)
class Dropout3d(nn.Dropout3d):
    def forward(self, input):
        return dropout3d(input, self.p, self.training, self.inplace)

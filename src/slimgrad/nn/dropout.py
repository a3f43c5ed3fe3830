"""Drop-in Dropout modules keeping 1 bit per element or an 8-byte seed for backward instead of the float
mask (the dropout policy: see :mod:`slimgrad.functional.dropout`)."""

from __future__ import annotations

from torch import nn

from slimgrad._registry import register
from slimgrad.functional.dropout import dropout, dropout1d, dropout2d, dropout3d, module_policy

__all__ = ["Dropout", "Dropout1d", "Dropout2d", "Dropout3d"]


@register(nn.Dropout)
class Dropout(nn.Dropout):
    def forward(self, input):
        # convert(model, dropout=...) sets the policy per module; otherwise the process-wide one.
        return dropout(input, self.p, self.training, self.inplace,
                       policy=module_policy(self))


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

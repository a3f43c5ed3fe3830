"""``nn.Linear`` that tells the layer before it when it keeps that layer's output.

Stock's linear already keeps only what its gradients read (x for the weight's gradient), so slimgrad computes
nothing differently here. But a slimgrad ReLU (and the clamp family) keeps a 1-bit mask only where no consumer
keeps its output: where one does, it keeps that output itself, shared, nothing extra (the producer/consumer rule
in :mod:`slimgrad.functional._common`). Consumers that are slimgrad layers report keeping their input; a stock
``nn.Linear`` never did, so a ReLU feeding a trainable linear layer (an MLP, OPT's and T5's feed-forward) kept
its mask beside the output the linear layer keeps: more than stock. This forward reports, then runs stock's.

The convert report counts these modules as stock (they keep what stock keeps); ``revert`` restores the class.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from slimgrad._registry import register
from slimgrad.functional._common import note_input_kept

__all__ = ["Linear"]


@register(nn.Linear)
class Linear(nn.Linear):
    #: convert counts these as stock (``ConversionReport.stock_minimal``): the same ops, the same bytes kept
    reports_only = True

    def forward(self, input):
        # stock's linear keeps x itself where its weight trains, unless autocast casts x first (then it keeps the
        # cast copy, and x is nobody's to share); note_input_kept returns at once under torch.compile
        weight = self.weight  # (nn.Module.__getattr__ once: ~0.3 us a lookup)
        if weight.requires_grad and not (torch._C._is_any_autocast_enabled() and _autocast_casts(input)):
            note_input_kept(input)
        return F.linear(input, weight, self.bias)


def _autocast_casts(input: torch.Tensor) -> bool:
    device = input.device.type
    return torch.is_autocast_enabled(device) and input.dtype != torch.get_autocast_dtype(device)

"""Drop-in BatchNorm1d/2d/3d and SyncBatchNorm that keep for backward only what the requested gradients read.

Only ``forward`` is overridden. Its preamble is stock ``_BatchNorm.forward``'s, line for line, because
that is where the module-level semantics live (num_batches_tracked, the cumulative average for
``momentum=None``, batch statistics in eval when ``track_running_stats=False``); the predecessor library
got each of those wrong by re-deriving them.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from slimgrad._registry import register
from slimgrad.functional.batch_norm import batch_norm

__all__ = ["BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "SyncBatchNorm"]


def _forward(self: nn.modules.batchnorm._BatchNorm, input: Tensor) -> Tensor:
    self._check_input_dim(input)

    if self.momentum is None:
        exponential_average_factor = 0.0
    else:
        exponential_average_factor = self.momentum

    if self.training and self.track_running_stats:
        if self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average
                exponential_average_factor = 1.0 / float(self.num_batches_tracked)
            else:
                exponential_average_factor = self.momentum

    # Batch statistics in training, and in eval when there are no running statistics.
    if self.training:
        bn_training = True
    else:
        bn_training = (self.running_mean is None) and (self.running_var is None)

    # Running statistics are passed only where they are updated (training and tracked) or used (eval).
    return batch_norm(
        input,
        self.running_mean if not self.training or self.track_running_stats else None,
        self.running_var if not self.training or self.track_running_stats else None,
        self.weight,
        self.bias,
        bn_training,
        exponential_average_factor,
        self.eps,
    )


@register(nn.BatchNorm1d)
class BatchNorm1d(nn.BatchNorm1d):
    forward = _forward


@register(nn.BatchNorm2d)
class BatchNorm2d(nn.BatchNorm2d):
    forward = _forward


@register(nn.BatchNorm3d)
class BatchNorm3d(nn.BatchNorm3d):
    forward = _forward


def _sync_forward(self: nn.SyncBatchNorm, input: Tensor) -> Tensor:
    """Stock's forward where it may synchronise statistics across processes (training under an initialised process
    group: its sync_batch_norm, GPU only); everywhere else SyncBatchNorm computes F.batch_norm, as the classes above
    (eval mode, frozen: keeps no input where stock keeps it)."""
    if self.training and torch.distributed.is_available() and torch.distributed.is_initialized():
        return nn.SyncBatchNorm.forward(self, input)
    self._check_non_zero_input_channels(input)
    return _forward(self, input)


@register(nn.SyncBatchNorm)
class SyncBatchNorm(nn.SyncBatchNorm):
    forward = _sync_forward

"""slimgrad: PyTorch layers that keep for backward only what the requested gradients read.

    model = slimgrad.convert(model)     # same numbers, less memory kept for backward
    slimgrad.revert(model)              # back to stock modules
"""

from . import functional, nn
from ._notices import SlimgradGapError, SlimgradWarning
from .audit import AuditReport, audit
from .convert import ConversionReport, convert, revert
from .estimate import MemoryEstimate, estimate, largest_fitting, scaling
from .functional.cross_entropy import fused_linear_cross_entropy
from .measure import SavedTensors, peak_bytes, saved_bytes
from .mode import enabled
from .plan import MemoryPlan, plan

__version__ = "0.1.0"
__all__ = [
    "AuditReport",
    "audit",
    "ConversionReport",
    "SavedTensors",
    "SlimgradGapError",
    "SlimgradWarning",
    "convert",
    "enabled",
    "estimate",
    "functional",
    "fused_linear_cross_entropy",
    "largest_fitting",
    "MemoryEstimate",
    "MemoryPlan",
    "nn",
    "peak_bytes",
    "plan",
    "revert",
    "saved_bytes",
    "scaling",
]

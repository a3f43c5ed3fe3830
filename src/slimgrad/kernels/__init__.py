"""Fast kernels behind one registry (see :mod:`slimgrad.kernels.registry`).

``cpu/`` holds JIT-compiled CPU kernels (numba), ``triton/`` GPU kernels; each family's implementations
register themselves when this package is imported, without importing numba or triton (that happens on
first use). Functions call :func:`choose`.
"""

from . import registry
from .registry import choose, format_table, get_preference, preference, register, set_preference, table

# The op families (their contracts and torch reference implementations), then the backends' packages,
# which register their kernels for those families (lazily: nothing heavy is imported here).
from . import dropout, max_pool, range_mask, relu_mask  # noqa: E402,F401  isort: skip
from . import cpu, triton  # noqa: E402,F401  isort: skip

__all__ = ["choose", "format_table", "get_preference", "preference", "register", "registry",
           "set_preference", "table"]

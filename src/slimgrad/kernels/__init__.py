"""Fast kernels behind one registry (see :mod:`slimgrad.kernels.registry`).

Each family module here holds the family's contract, its torch reference and the registration of the compiled
core's kernel for it (:mod:`slimgrad.csrc`, built on first use); ``triton/`` holds GPU kernels. Nothing heavy is
imported or built when this package is imported (that happens on first use). Functions call :func:`choose`.
"""

from . import registry
from .registry import choose, format_table, get_preference, preference, register, set_preference, table

# The op families (their contracts and torch reference implementations), then the backends' packages,
# which register their kernels for those families (lazily: nothing heavy is imported here).
from . import dropout, max_pool, range_mask, relu_mask  # noqa: E402,F401  isort: skip
from . import triton  # noqa: E402,F401  isort: skip

__all__ = ["choose", "format_table", "get_preference", "preference", "register", "registry",
           "set_preference", "table"]

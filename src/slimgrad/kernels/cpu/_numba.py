"""numba set-up shared by the CPU kernels: the on-disk cache and the one-time report of the JIT cost.

Every kernel is ``@njit(cache=True, nogil=True)``: compiled on its first call (about a second per kernel
and dtype on the development CPU) and cached on disk, so later processes load it in milliseconds.
numba writes its cache next to the source (``__pycache__``); where that is read-only (a system
site-packages) it falls back to a per-user directory by itself. ``NUMBA_CACHE_DIR`` overrides both. The
first compilation in a process is logged once on the ``slimgrad`` logger, with where the cache lives.

Threads: the kernels run ``parallel=False`` by default, one thread, memory-bound passes. Measured on the
2-core development CPU (fp32 8x64x56x56): numba's own thread pool (``prange``) gained nothing over one
thread for these passes and contended with torch's OpenMP pool in the surrounding ops; set
``SLIMGRAD_NUMBA_PARALLEL=1`` to compile the parallel variants instead.
"""

from __future__ import annotations

import logging
import os
import time

import numba

log = logging.getLogger("slimgrad")

PARALLEL = os.environ.get("SLIMGRAD_NUMBA_PARALLEL", "0") not in ("", "0")
prange = numba.prange if PARALLEL else range
_reported = False


def jit(fn):
    """``numba.njit`` with slimgrad's options: cached on disk, releases the GIL, parallel when asked."""
    return numba.njit(cache=True, nogil=True, parallel=PARALLEL)(fn)


def as_flat_numpy(t):
    """A contiguous CPU tensor as a 1-D numpy view (numpy's reshape of a contiguous array is cheaper than
    torch's)."""
    return t.detach().numpy().reshape(-1)


def report_first_compile(started: float, what: str) -> None:
    """Log, once per process, how long the first kernel took to load (compile or read from the cache)."""
    global _reported
    if _reported:
        return
    _reported = True
    cache = os.environ.get("NUMBA_CACHE_DIR") or "next to slimgrad's sources (or numba's per-user cache)"
    log.info("slimgrad: first numba kernel (%s) ready in %.2f s; cache: %s", what, time.perf_counter() - started,
             cache)

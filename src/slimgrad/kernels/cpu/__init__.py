"""JIT-compiled CPU kernels (numba; compiled on first use and cached on disk). Each family's module
registers its kernels here with ``registry.register(..., load=...)`` so numba is imported only when a
kernel first runs."""

"""Triton kernels for CUDA tensors (and CPU tensors under ``TRITON_INTERPRET=1``). Each family's module
registers its kernels here with ``registry.register(..., load=...)`` so triton is imported only when a
kernel first runs."""

"""Kernel family ``relu_mask``: ReLU / LeakyReLU forward that also packs the 1-bit mask backward needs,
and the backward that reads that mask instead of a float tensor.

Contract (every backend implements exactly this; the torch backend below is the reference the tests
compare the others with)::

    impl.forward(x, negative_slope, inplace) -> (out, packed)
    impl.backward(grad, packed, negative_slope) -> grad_input

* ``x``: a **contiguous** floating tensor (the Function hands channels_last and other dense layouts over
  as their contiguous permuted view, and copies non-dense inputs first), any shape, numel >= 0.
* ``negative_slope``: ``None`` for relu, a float for leaky_relu. For ``inplace=True`` with leaky_relu the
  Function guarantees ``negative_slope >= 0`` (stock refuses the negative case in backward).
* ``inplace``: write the result into ``x`` and return ``x`` itself as ``out``; the mask must describe the
  input *before* it was overwritten (one pass: read, decide, write both).
* ``out``: bitwise stock's ``torch.relu(x)`` / ``torch._C._nn.leaky_relu(x, slope)``, contiguous:
  relu is ``x < 0 ? +0.0 : x`` (NaN and ``-0.0`` pass through unchanged, ``-inf`` gives ``+0.0``);
  leaky_relu is ``x > 0 ? x : x * slope`` (NaN takes the product branch and stays NaN).
* ``packed``: ``uint8``, 1-D, ``ceil(numel / 8)`` bytes, bit ``i % 8`` (LSB first) of byte ``i // 8`` holds
  element ``i`` of ``x.reshape(-1)``, unused high bits of the last byte zero
  (``numpy.packbits(..., bitorder="little")``, the format of :mod:`slimgrad.kernels.bitmask`). The bit
  says "the gradient passes unscaled":

  - relu: ``out != 0`` — set for ``x > 0`` and for NaN (stock's ``threshold_backward(grad, out, 0)`` is
    ``out <= 0 ? 0 : grad``, and ``NaN <= 0`` is false); clear for ``-inf``, ``±0`` and negatives.
  - leaky_relu: ``x > 0`` — clear for NaN (stock's ``leaky_relu_backward`` takes the slope branch there).
* ``grad``: contiguous, ``x``'s shape and dtype, never requiring grad (the Function handles double
  backward itself). ``grad_input``: a new contiguous tensor, bitwise
  ``bit ? grad : +0.0`` (relu; ``+0.0``, not ``grad * 0``, so ``inf``/NaN gradients give ``+0``) or
  ``bit ? grad : grad * negative_slope`` (leaky_relu, the product rounded in the dtype as stock does:
  for bf16/fp16 computed in fp32 and rounded once).

Dtypes: float32, float64, bfloat16, float16 for the torch backend; a fast backend declares what it
handles (the registry falls back to torch for the rest).
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from . import registry

__all__ = ["FAMILY", "CoreReluMask", "TorchReluMask", "choose"]

FAMILY = "relu_mask"
_FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_NUMPY_DTYPES = (torch.float16, torch.float32, torch.float64)
_SAME_SIZE_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class TorchReluMask:
    """The reference: stock's ops, numpy's comparison and ``packbits`` on CPU in eager mode.

    Measured on the development CPU (8x64x56x56 fp32, 2 threads, forward + backward): stock relu 0.87 ms;
    this path 1.81 ms (numpy compare + packbits, unpackbits + integer multiply); torch-only shift-or
    packing 3.16 ms. Torch's bool-producing comparisons and ``torch.where`` are the slow parts on CPU,
    hence numpy for the comparison and, in backward, the gradient's bits multiplied by the 0/1 mask.
    """

    name = "torch"

    @staticmethod
    def forward(x: torch.Tensor, negative_slope, inplace: bool):
        from slimgrad.kernels import bitmask as _bitmask

        relu = negative_slope is None
        if not relu and not inplace:
            ref = x  # leaky: the input's sign, read before anything is written
        if inplace:
            if not relu:
                # After an in-place leaky_relu with slope >= 0 the output has the input's sign.
                torch._C._nn.leaky_relu_(x, negative_slope)
            else:
                torch.relu_(x)
            out = x
            ref = out
        elif relu:
            out = torch.relu(x)
            ref = out
        else:
            out = torch._C._nn.leaky_relu(x, negative_slope)
        if torch.compiler.is_compiling():
            mask = (ref != 0) if relu else (ref > 0)
            flat = mask.reshape(-1)
            pad = _bitmask.packed_numel(flat.numel()) * 8 - flat.numel()
            flat = torch.cat([flat, flat.new_zeros(pad)])
        else:
            flat, view = _bitmask.new_padded_mask(ref.shape, ref.device)
            if ref.dtype in _NUMPY_DTYPES and _bitmask.use_numpy(ref):
                # numpy's comparisons run several times faster than torch's bool-producing ones on CPU.
                (np.not_equal if relu else np.greater)(ref.detach().numpy(), 0, out=view.numpy())
            elif relu:
                torch.ne(ref, 0, out=view)
            else:
                torch.gt(ref, 0, out=view)
        return out, _bitmask.pack(flat)

    @staticmethod
    def backward(grad: torch.Tensor, packed: torch.Tensor, negative_slope):
        from slimgrad.kernels import bitmask as _bitmask

        mask = _bitmask.unpack(packed, grad.shape)
        if negative_slope is None:
            # Multiplying the gradient's bits by 0/1 is where(mask, grad, +0) bit for bit, and much faster
            # on CPU than torch.where with a bool condition.
            bits = grad.view(_SAME_SIZE_INT[grad.element_size()])
            return (bits * mask).view(grad.dtype)
        # Stock's own kernel, reading the 0/1 mask where it would read the input's sign.
        return torch.ops.aten.leaky_relu_backward(grad, mask.view(torch.uint8), negative_slope, False)


TORCH_IMPL = TorchReluMask()

registry.register(FAMILY, registry.TORCH, devices=("cpu", "cuda", "meta"), dtypes=_FLOATS,
                  load=lambda: TORCH_IMPL, priority=0, note="stock ops + numpy packbits (reference)")


class CoreReluMask:
    """The compiled core's one-pass kernels (``slimgrad/csrc/relu_mask.cpp``): forward reads x once and writes
    the output and the packed mask in the same parallel pass (vectorised for fp32 and the 16-bit dtypes),
    backward reads the gradient and the mask once. Supersedes numba for this family (priority 20)."""

    name = "core"

    def __init__(self, core):
        self.forward = core.relu_mask_forward
        self.backward = core.relu_mask_backward



registry.register(FAMILY, registry.CORE, devices=("cpu",), dtypes=_FLOATS, priority=20,
                  load=registry.core_loader(CoreReluMask),
                  note="compiled core: one pass for output and mask")


class CoreReluMaskSimulation:
    """What the core's kernels allocate (``relu_mask_forward``: the packed mask, then the output unless in place;
    ``relu_mask_backward``: the gradient), without data: for fake tensors (``slimgrad.estimate``) whose real ones
    would get the core (:func:`registry.simulates_core`)."""

    name = "core-simulation"

    @staticmethod
    def forward(x, negative_slope, inplace):
        packed = torch.empty(((x.numel() + 7) // 8,), dtype=torch.uint8, device=x.device)
        return (x if inplace else torch.empty(x.shape, dtype=x.dtype, device=x.device)), packed

    @staticmethod
    def backward(grad, packed, negative_slope):
        return torch.empty(grad.shape, dtype=grad.dtype, device=grad.device)


CORE_SIMULATION = CoreReluMaskSimulation()


# CUDA tensors of up to this many elements run the core (relu_mask.cpp: its own one-pass CUDA kernels where it was
# built with nvcc, else its aten route, a few small kernels launched from C++ moving about twice the bytes stock's relu
# moves; no Python Function either way); larger ones the Python Function's one-pass Triton kernel, whose host cost a
# step that large hides behind the GPU's work.
CORE_CUDA_MAX_NUMEL = 1 << 22


class CoreAtenReluMaskSimulation:
    """What the core's aten route allocates on CUDA (relu_mask.cpp's ``aten_forward`` / ``aten_backward``), in its
    order, without data: forward the packed mask, the 0/1 bytes (weighted in place, then summed into the mask) and
    the output unless in place; backward each element's bit in its byte, then the gradient.
    For fake CUDA tensors (``slimgrad.estimate``) whose real ones would run that route."""

    name = "core-aten-simulation"

    @staticmethod
    def forward(x, negative_slope, inplace):
        nb = (x.numel() + 7) // 8
        packed = torch.empty((nb,), dtype=torch.uint8, device=x.device)
        bits = torch.empty((nb * 8,), dtype=torch.uint8, device=x.device)
        out = x if inplace else torch.empty(x.shape, dtype=x.dtype, device=x.device)
        del bits
        return out, packed

    @staticmethod
    def backward(grad, packed, negative_slope):
        bits = torch.empty((packed.numel() * 8,), dtype=torch.uint8, device=grad.device)
        out = torch.empty(grad.shape, dtype=grad.dtype, device=grad.device)
        del bits
        return out


CORE_ATEN_SIMULATION = CoreAtenReluMaskSimulation()


def core_serves_cuda(x: torch.Tensor) -> bool:
    """Whether an eager call on CUDA tensor ``x`` (or its fake) runs the core's aten route, by size; the caller
    asks the core's own conditions (slimgrad.csrc.for_eager)."""
    return x.numel() <= CORE_CUDA_MAX_NUMEL


_ATEN_ON_CPU = [False]


@contextlib.contextmanager
def aten_route_on_cpu():
    """Tests: inside, the core runs its aten route (CUDA's) on CPU tensors too, and the estimate's fake CPU tensors
    simulate that route, so both are checked without a GPU."""
    from slimgrad import csrc

    old = csrc.core().relu_mask_force_aten(True)
    _ATEN_ON_CPU[0] = True
    try:
        yield
    finally:
        csrc.core().relu_mask_force_aten(old)
        _ATEN_ON_CPU[0] = old


def _simulates_aten_route(x: torch.Tensor) -> bool:
    if x.device.type == "cpu":
        if not _ATEN_ON_CPU[0]:
            return False
    elif x.device.type != "cuda" or not core_serves_cuda(x):
        return False
    if torch.compiler.is_compiling() or not registry._is_fake(x):
        return False
    from slimgrad import csrc

    return csrc.enabled() and csrc._STATE["cuda"] and csrc.core() is not None


def _core_has_cuda_kernels() -> bool:
    from slimgrad import csrc

    module = csrc.core()
    return module is not None and bool(module.cuda_kernels())


def choose(x: torch.Tensor):
    """The implementation for ``x`` (the registry's choice; the torch reference while compiling, since
    the fast backends are eager-only; for the estimate's fake tensors the core's allocations, on CPU its kernels',
    on CUDA its aten route's)."""
    if type(x) is not torch.Tensor:
        if _simulates_aten_route(x):
            # a core built with its CUDA kernels runs them on CUDA tensors: the CPU kernels' allocations
            return CORE_SIMULATION if x.device.type == "cuda" and _core_has_cuda_kernels() else CORE_ATEN_SIMULATION
        if registry.simulates_core(FAMILY, x):
            return CORE_SIMULATION
    return registry.choose_or_reference(FAMILY, x, TORCH_IMPL)

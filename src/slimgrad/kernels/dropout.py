"""Kernel families ``dropout_bits`` and ``dropout_seed``: the two ways slimgrad's dropout keeps its mask.

Which one runs is the dropout *policy* (:mod:`slimgrad.functional.dropout`): ``bits`` keeps the mask as
one bit per element and never draws twice; ``seed`` keeps an 8-byte seed and regenerates the mask in
backward; ``auto`` picks per device by measurement (bits on CPU, where a second ``bernoulli_`` draw is
slow; seed on CUDA, where a counter-based generator is nearly free).

``dropout_bits`` contract::

    impl.forward(x, keep, scale, inplace) -> (out, packed)
    impl.backward(grad, packed, scale, out=None) -> grad_input

* ``x``: contiguous floating tensor. ``keep``: a contiguous ``uint8`` tensor of ``x``'s shape, 1 where the
  element is kept. The Function draws it with torch's own ``bernoulli_(1 - p)`` into
  ``empty_like(x, dtype=uint8)``, which on CPU consumes the default generator exactly as stock's
  ``empty_like(x).bernoulli_(1 - p)`` does, so the mask is stock's, bit for bit, for the same seed.
* ``scale``: a Python float, the value stock's noise holds at kept elements (``1 / (1 - p)`` as stock's
  ``noise.div_(1 - p)`` rounds it in ``x``'s dtype), exactly representable in that dtype.
* ``out = x * (keep ? scale : 0)``, the product rounded once in ``x``'s dtype (bf16/fp16: computed in
  fp32), bitwise stock's ``x * noise`` (so ``-x * 0 = -0.0``, ``inf * 0 = NaN``, as stock). ``inplace``:
  written into ``x``, which is returned.
* ``packed``: ``keep`` packed in the :mod:`slimgrad.kernels.bitmask` format (uint8, ``ceil(numel/8)``
  bytes, element ``i`` of ``keep.reshape(-1)`` in bit ``i % 8`` of byte ``i // 8``, LSB first).
* ``grad``: contiguous, ``x``'s shape; ``grad_input = grad * (bit ? scale : 0)`` rounded as above (stock's
  ``grad * noise``), a new contiguous tensor, or written into ``out`` (contiguous, grad's shape and dtype;
  may be ``grad`` itself) and returned when given.

``dropout_seed`` contract::

    impl.forward(x, p, seed, inplace) -> out
    impl.backward(grad, p, seed) -> grad_input

* ``seed``: an int64 scalar tensor on ``x``'s device (drawn by the Function from the device's default
  generator, so ``manual_seed`` and checkpointing reproduce it). The mask is a pure function of
  ``(seed, element index, p)``: backward regenerates it. ``x``/``grad`` contiguous; ``out = x * noise``,
  ``grad_input = grad * noise`` with ``noise = keep ? scale : 0`` as above. The mask differs from stock's
  (another generator), identically in forward and backward, and is the same for every backend: Philox4x32-10 on
  the element's logical index, Triton's ``tl.rand`` stream (:func:`philox_keep`; the core's ``csrc/philox.h``), so
  a mask one backend drew (Triton on CUDA, the core on CPU, the torch reference for float64 or with the core off)
  any other regenerates, and the same seed gives the same mask on CPU and CUDA.

A backward that torch.compile traces over an eager forward (compiled autograd) must not ask the registry for its
``dropout_seed`` kernel: while tracing it answers the torch reference, whose mask is not the one a Triton forward
applied. It calls :func:`traced_seed_apply`, an opaque op that runs the forward's kernel (by name, or the registry's
eager choice) on the real tensors when the graph runs.

The compiled core registers ``dropout_seed`` as backend ``core`` on CPU (``csrc/dropout_seed.cpp``: the Philox mask
made and applied in one parallel pass; the reference's integer ops take ~200 passes over int64 temporaries), and
(:mod:`slimgrad.csrc`, ``csrc/dropout.cpp``) ``dropout_bits`` as backend ``core``
(priority 20, above numba's 10): one parallel pass that applies the mask and packs it (bf16/fp16 in fp32,
rounded once, as stock's ``mul``), for all four float dtypes, so the Python Function also runs it where the
core is built. The scale (:func:`noise_scale`) is computed once per ``(p, dtype)``: ``.item()`` per call was a
measured per-call cost (issue 22).
"""

from __future__ import annotations

import functools
import math

import torch

from . import registry

__all__ = ["BITS", "SEED", "CoreDropoutBits", "CoreDropoutSeed", "SimulatedCoreSeed", "TorchDropoutBits",
           "TorchDropoutSeed", "choose_bits", "choose_seed", "noise_scale", "philox_first_word", "philox_keep",
           "philox_noise", "seed_kernel", "traced_seed_apply", "TracedSeed", "TRACED_SEED"]

BITS, SEED = "dropout_bits", "dropout_seed"
_FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


@functools.lru_cache(maxsize=256)
def noise_scale(p: float, dtype: torch.dtype) -> float:
    """The value of stock's noise at kept elements: ``1 / (1 - p)`` rounded by ``div_`` in ``dtype`` (once per
    ``(p, dtype)``: a host sync per call otherwise)."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():  # a real CPU scalar also under a fake-tensor mode (slimgrad.estimate)
        return torch.ones((), dtype=dtype, device="cpu").div_(1 - p).item()  # (not the default device: meta)


def scaled_mask(mask: torch.Tensor, scale: float) -> torch.Tensor:
    """``mask`` (0/1 in a float dtype) made the noise in place: the scale where kept, +0 where dropped. Where the
    dtype rounds the scale to inf (fp16, p > 1 - 1/65504) a product would make 0 * inf = NaN at the dropped elements,
    where stock's noise (``bernoulli_`` then ``div_``) is 0 (the degenerate-shapes sweep)."""
    if math.isfinite(scale):
        return mask.mul_(scale)
    return mask.masked_fill_(mask != 0, scale)


class TorchDropoutBits:
    """Reference: the float noise rebuilt from the mask with torch ops, numpy ``packbits`` on CPU."""

    name = "torch"

    @staticmethod
    def forward(x, keep, scale, inplace):
        from slimgrad.kernels import bitmask as _bitmask

        noise = scaled_mask(keep.to(x.dtype), scale)
        out = x.mul_(noise) if inplace else x * noise
        del noise
        flat, view = _bitmask.new_padded_mask(keep.shape, keep.device)
        view.copy_(keep.view(torch.bool))
        return out, _bitmask.pack(flat)

    @staticmethod
    def backward(grad, packed, scale, out=None):
        from slimgrad.kernels import bitmask as _bitmask

        noise = scaled_mask(_bitmask.unpack(packed, grad.shape).to(grad.dtype), scale)
        return grad * noise if out is None else torch.mul(grad, noise, out=out)


# Philox4x32-10, Triton's ``tl.rand`` stream (csrc/philox.h has the same function for the core's kernels).
_M32 = 0xFFFFFFFF
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85
_UNIFORM_SCALE = 4.6566127342e-10  # as a float32: the largest s with (2**31 - 1) * s < 1
# elements per pass: bounds the reference's int64 temporaries (~10 of them, ~80 bytes an element). On CPU a 64th of
# the tensor, between 256 and 16 Ki elements: ~1.3 bytes an element beside a 4-byte noise (a sixteenth put a small
# LoRA step's peak 13 % above peft's), at most 1.3 MiB; 16 Ki also ran fastest (4 Ki and 64 Ki ~30 % slower, 1 Ki
# 4x). On CUDA, where the reference serves float64 and tensors of 2**31 elements or more and each pass is ~200
# launches, 1 Mi.
_PHILOX_CHUNK = {"cuda": (1 << 20, 1 << 20)}
_PHILOX_CHUNK_DEFAULT = (1 << 8, 1 << 14)


def _mul32(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The high and low 32-bit words of ``a * b`` for a constant ``a < 2**32`` and ``b``'s int64 values in
    ``[0, 2**32)``, in 16-bit halves so that no int64 product overflows."""
    t = (b & 0xFFFF) * a  # < 2**48
    u = (b >> 16) * a + (t >> 16)  # < 2**48 + 2**32
    return u >> 16, ((u & 0xFFFF) << 16) | (t & 0xFFFF)


def philox_first_word(c0: torch.Tensor, c1: torch.Tensor, k0: torch.Tensor, k1: torch.Tensor) -> torch.Tensor:
    """The first output word of Philox4x32-10 (Salmon et al. 2011, Random123's constants) for counter
    ``(c0, c1, 0, 0)`` and key ``(k0, k1)``: 32-bit words held in int64 tensors, broadcast together."""
    c2 = c3 = torch.zeros_like(c0)
    for _ in range(10):
        hi_b, lo_b = _mul32(_ROUND_B, c2)
        hi_a, lo_a = _mul32(_ROUND_A, c0)
        c0, c2 = hi_b ^ c1 ^ k0, hi_a ^ c3 ^ k1
        c1, c3 = lo_b, lo_a
        k0, k1 = (k0 + _KEY_A) & _M32, (k1 + _KEY_B) & _M32
    return c0


def _philox_uniform(index: torch.Tensor, seed: torch.Tensor) -> torch.Tensor:
    """Triton's ``tl.rand(seed, index)`` (float32) for int64 element indices, with torch's integer ops: the key is
    the int64 seed read as unsigned, as Triton's ``philox`` reads it."""
    word = philox_first_word(index & _M32, (index >> 32) & _M32, seed & _M32, (seed >> 32) & _M32)
    folded = torch.where(word > 0x7FFFFFFF, _M32 - word, word)  # int32(x) < 0 ? ~x : x
    scale = torch.tensor(_UNIFORM_SCALE, dtype=torch.float32, device=index.device)
    return folded.to(torch.float32) * scale


def _philox_fill(out: torch.Tensor, p: float, seed: torch.Tensor) -> torch.Tensor:
    """``out`` (flat, contiguous) set to the keep mask, 1 / True where element ``i`` is kept, chunk by chunk: the
    integer temporaries stay at a chunk's (no mask-sized bool beside a noise)."""
    device = out.device
    p32 = torch.tensor(p, dtype=torch.float32, device=device)
    seed = seed.reshape(())
    numel = out.numel()
    lo, hi = _PHILOX_CHUNK.get(device.type, _PHILOX_CHUNK_DEFAULT)
    chunk = min(max(numel // 64, lo), hi)
    for start in range(0, numel, chunk):
        index = torch.arange(start, min(start + chunk, numel), dtype=torch.int64, device=device)
        out[start:start + index.numel()].copy_(_philox_uniform(index, seed) >= p32)
    return out


def philox_keep(shape, p: float, seed: torch.Tensor) -> torch.Tensor:
    """The "seed" policy's mask (bool, ``shape``, on ``seed``'s device, elements in logical row-major order): element
    ``i`` is kept where Triton's ``tl.rand(seed, i) >= p`` (p as float32), the mask every ``dropout_seed`` backend
    applies (Triton's kernels, the core's, this reference), so any of them regenerates another's."""
    numel = 1
    for size in shape:
        numel *= int(size)
    keep = _philox_fill(torch.empty(numel, dtype=torch.bool, device=seed.device), p, seed)
    return keep.view(tuple(int(s) for s in shape))


def philox_noise(like: torch.Tensor, p: float, seed: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The "seed" policy's noise (``keep ? scale : 0`` in ``like``'s dtype, stock's rounded scale), contiguous, of
    ``like``'s shape; written into ``out`` (contiguous, like's shape and dtype) when given."""
    noise = torch.empty(like.shape, dtype=like.dtype, device=like.device) if out is None else out
    _philox_fill(noise.view(-1), p, seed)
    return scaled_mask(noise, noise_scale(p, like.dtype))


class TorchDropoutSeed:
    """Reference: :func:`philox_noise` with torch's ops, then stock's product. On fake tensors (``slimgrad.estimate``)
    and meta ones it runs the same ops: the simulation sees its very allocations."""

    name = "torch"

    @staticmethod
    def noise(like, p, seed):
        return philox_noise(like, p, seed)

    @classmethod
    def forward(cls, x, p, seed, inplace):
        noise = cls.noise(x, p, seed)
        return x.mul_(noise) if inplace else x * noise

    @classmethod
    def backward(cls, grad, p, seed):
        return grad * cls.noise(grad, p, seed)


class CoreDropoutSeed:
    """The compiled core's kernels (``csrc/dropout_seed.cpp``): the same Philox mask, regenerated and applied in one
    parallel pass."""

    name = "core"

    def __init__(self, core):
        self.forward = core.dropout_seed_forward
        self.backward = core.dropout_seed_backward
        self.keep_mask = core.dropout_seed_keep_mask


BITS_TORCH = TorchDropoutBits()
SEED_TORCH = TorchDropoutSeed()

registry.register(BITS, registry.TORCH, devices=("cpu", "cuda"), dtypes=_FLOATS, load=lambda: BITS_TORCH,
                  note="torch ops + numpy packbits (reference)")
class CoreDropoutBits:
    """The compiled core's one-pass kernels (``csrc/dropout.cpp``), the ``dropout_bits`` contract."""

    name = "core"

    def __init__(self, core):
        self.forward = core.dropout_bits_forward
        self.backward = core.dropout_bits_backward



registry.register(BITS, registry.CORE, devices=("cpu",), dtypes=_FLOATS, priority=20,
                  load=registry.core_loader(CoreDropoutBits),
                  note="compiled core: mask applied and packed in one parallel pass")
registry.register(SEED, registry.TORCH, devices=("cpu", "cuda"), dtypes=_FLOATS, load=lambda: SEED_TORCH,
                  note="Philox with torch's integer ops (reference)")
registry.register(SEED, registry.CORE, devices=("cpu",), dtypes=_FLOATS, priority=20,
                  load=registry.core_loader(CoreDropoutSeed),
                  note="compiled core: Philox mask regenerated and applied in one parallel pass")


def choose_bits(x: torch.Tensor):
    return registry.choose_or_reference(BITS, x, BITS_TORCH)


class SimulatedCoreSeed:
    """The core's ``dropout_seed`` kernels on fake tensors (``slimgrad.estimate``), which they cannot read: what they
    allocate, one output (none in place)."""

    name = "core"

    @staticmethod
    def forward(x, p, seed, inplace):
        return x if inplace else torch.empty_like(x)

    @staticmethod
    def backward(grad, p, seed):
        return torch.empty_like(grad)


SIMULATED_CORE_SEED = SimulatedCoreSeed()


def choose_seed(x: torch.Tensor):
    if type(x) is not torch.Tensor and registry.simulates_core(SEED, x):
        return SIMULATED_CORE_SEED
    return registry.choose_or_reference(SEED, x, SEED_TORCH)


def seed_kernel(backend: str, like: torch.Tensor):
    """The ``dropout_seed`` implementation of ``backend`` ("torch", "triton"); ``""``: the one the registry
    chooses for ``like`` now, as an eager call would (:func:`choose_seed` outside torch.compile)."""
    if not backend:
        return registry.choose(SEED, like) or SEED_TORCH
    if backend == registry.TORCH:
        return SEED_TORCH
    for kernel in registry.implementations(SEED):
        if kernel.backend == backend and kernel.available:
            return kernel.implementation()
    raise RuntimeError(f"slimgrad: the dropout_seed kernel {backend!r} drew a mask in forward but is unavailable "
                       f"in backward (python -m slimgrad kernels says why)")


@torch.library.custom_op("slimgrad::dropout_seed_apply", mutates_args=())
def _seed_apply(t: torch.Tensor, p: float, seed: torch.Tensor, backend: str) -> torch.Tensor:
    return seed_kernel(backend, t).backward(t, p, seed)


@_seed_apply.register_fake
def _seed_apply_fake(t, p, seed, backend):
    return torch.empty_like(t)


def _seed_apply_setup(ctx, inputs, output):
    _, ctx.p, seed, ctx.backend = inputs
    ctx.save_for_backward(seed)


def _seed_apply_backward(ctx, grad):  # d(t * noise)/dt: the same noise (a double backward through the op)
    (seed,) = ctx.saved_tensors
    return _seed_apply(grad.contiguous(), ctx.p, seed, ctx.backend), None, None, None


_seed_apply.register_autograd(_seed_apply_backward, setup_context=_seed_apply_setup)


def traced_seed_apply(t: torch.Tensor, p: float, seed: torch.Tensor, backend: str) -> torch.Tensor:
    """``t * noise`` with the noise of ``seed`` drawn by the ``backend`` kernel (``""``: the one the registry
    chooses for ``t`` at run time), for a backward traced by torch.compile (compiled autograd over an eager
    forward). ``t`` contiguous; a new contiguous tensor.

    Why an opaque op: while tracing, :func:`choose_seed` answers with the torch reference (the fast backends are
    eager-only), whose ``torch.Generator`` draws another mask than the counter-based Triton kernel an eager CUDA
    forward ran, so the gradient would use a mask the forward never applied. The op runs the forward's kernel on
    real tensors when the compiled graph runs (and reads the seed without a graph break for ``.item()``)."""
    return _seed_apply(t, p, seed, backend)


class TracedSeed:
    """The ``dropout_seed`` contract (out of place) through :func:`traced_seed_apply` with the kernel the registry
    chooses when the traced graph runs: for a traced backward that does not know which kernel its eager forward ran
    (LoRA's asks the registry again, eager as well)."""

    name = ""

    @staticmethod
    def forward(x, p, seed, inplace):
        if inplace:
            raise ValueError("slimgrad: TracedSeed.forward's argument 'inplace' must be False (an opaque op)")
        return traced_seed_apply(x, p, seed, "")

    @staticmethod
    def backward(grad, p, seed):
        return traced_seed_apply(grad, p, seed, "")


TRACED_SEED = TracedSeed()

"""Bit-packed boolean masks: one bit per element, so a ReLU keeps 1/32 of what a float32 output costs.

Format (identical on every path, so a mask packed on one path unpacks on any other): elements in
row-major (logical) order, element ``i`` in bit ``i % 8`` (least significant first) of byte ``i // 8``,
unused high bits of the last byte zero. That is ``numpy.packbits(..., bitorder="little")``.

Two implementations:

* torch ops only (device-agnostic): eight mask bytes are read as one int64 whose byte ``i`` is 0 or 1,
  and three shift-or steps gather the eight low bits into the low byte; unpacking spreads them back with
  three shift-and-mask steps. This relies on little-endian byte order of the int64 view, checked at
  import. Under ``torch.compile`` the same format is built with per-bit shifts and a sum instead, which
  Inductor fuses (it cannot lower the bool/int64 bit views).
* numpy's ``packbits``/``unpackbits`` for CPU tensors in eager mode: one pass each instead of several
  full-size torch temporaries, measured faster on CPU (see the report in ``activation.py``).

Under ``torch.compile`` the Functions use planar formats instead, :func:`pack_planar` /
:func:`unpack_planar`, eight equal planes, plane ``k`` in bit ``k``: on the CPU a feature map's pixels in
channels-last order (byte ``(p, c)`` holds pixel ``p + k * P / 8`` of channel ``c``, see
:func:`planar_layout`), elsewhere the flat mask in its traced memory order (element ``k * M + j`` in byte
``j``, ``M = ceil(numel / 8)``). Both sides are affine row operations that Inductor vectorizes and fuses into
the producing and consuming kernels; the format above needs ``byte[i // 8] >> (i % 8)``, which it compiles
to element-wise scalar code (measured on the width-8 ResNet-18 step: the fused unpack + batch-norm backward
kernels took 0.2-0.9 ms each, ~20% of the step). A Function records which format it packed (``ctx``) and
unpacks with the same one, so a backward traced by compiled autograd after an eager forward still reads the
eager format.
"""

from __future__ import annotations

import math
import sys

import numpy as np
import torch

__all__ = ["packed_numel", "new_padded_mask", "pack", "unpack", "pack_planar", "unpack_planar", "planar_layout",
           "PIXEL_PLANES", "pack_vmappable", "unpack_vmappable"]

if sys.byteorder != "little":  # pragma: no cover - every platform torch ships for is little-endian
    raise ImportError("slimgrad's bit-packed masks read bytes through an int64 view and need a "
                      "little-endian machine")

_GATHER_MASK = 0xFF
_SPREAD_1 = 0x0000000F0000000F
_SPREAD_2 = 0x0003000300030003
_SPREAD_3 = 0x0101010101010101


def packed_numel(numel: int) -> int:
    """Bytes a packed mask of ``numel`` elements takes: ceil(numel / 8)."""
    return (numel + 7) // 8


def new_padded_mask(shape, device) -> tuple[torch.Tensor, torch.Tensor]:
    """An uninitialised bool buffer for a mask of ``shape``, padded to a multiple of 8 elements.

    Returns ``(flat, view)``: write the mask into ``view`` (contiguous, of ``shape``, e.g. through a
    comparison's ``out=``) and pass ``flat`` to :func:`pack`. Writing straight into the padded buffer
    saves the copy that padding an existing mask would cost. The padding is already zero.
    """
    numel = math.prod(shape)
    flat = torch.empty(packed_numel(numel) * 8, dtype=torch.bool, device=device)
    flat[numel:].zero_()
    return flat, flat[:numel].view(shape)


def use_numpy(t: torch.Tensor) -> bool:
    """Whether ``t`` may go through numpy: a plain CPU tensor, outside ``torch.compile`` tracing."""
    return (
        t.device.type == "cpu"
        and type(t) is torch.Tensor
        and not torch.compiler.is_compiling()
    )


def _shifts(device, dtype=torch.uint8) -> torch.Tensor:
    return torch.arange(8, dtype=dtype, device=device)


def _pack_torch(flat: torch.Tensor) -> torch.Tensor:
    if torch.compiler.is_compiling():
        # Inductor cannot lower bool<->int64 bit views; shifts and a sum fuse into one kernel instead.
        return (flat.view(-1, 8).to(torch.uint8) << _shifts(flat.device)).sum(1, dtype=torch.uint8)
    v = flat.view(torch.uint8).view(torch.int64)
    t = v | (v >> 7)
    t |= t >> 14
    t |= t >> 28
    return (t & _GATHER_MASK).to(torch.uint8)


def _unpack_torch(packed: torch.Tensor, numel: int) -> torch.Tensor:
    if torch.compiler.is_compiling():
        return ((packed[:, None] >> _shifts(packed.device)) & 1).to(torch.bool).view(-1)[:numel]
    t = packed.to(torch.int64)
    t = (t | (t << 28)) & _SPREAD_1
    t = (t | (t << 14)) & _SPREAD_2
    t = (t | (t << 7)) & _SPREAD_3
    return t.view(torch.uint8).view(torch.bool)[:numel]


def pack(flat: torch.Tensor, *, impl: str = "auto") -> torch.Tensor:
    """Pack a flat bool tensor whose length is a multiple of 8 (see :func:`new_padded_mask`) into
    ``len // 8`` uint8 bytes. ``impl``: "auto" (numpy on CPU in eager mode, else torch), "torch", "numpy".
    """
    if flat.dtype != torch.bool or flat.dim() != 1 or flat.numel() % 8:
        raise ValueError(f"pack: 'flat' must be a 1-D bool tensor whose length is a multiple of 8, got "
                         f"{flat.dtype} of shape {tuple(flat.shape)}")
    if impl == "numpy" or (impl == "auto" and use_numpy(flat)):
        return torch.from_numpy(np.packbits(flat.contiguous().numpy(), bitorder="little"))
    if impl == "auto" and _stands_for_numpy(flat):
        return torch.empty(flat.numel() // 8, dtype=torch.uint8, device=flat.device)  # packbits' result
    return _pack_torch(flat.contiguous())


def unpack(packed: torch.Tensor, shape, *, impl: str = "auto") -> torch.Tensor:
    """The bool mask of ``shape`` (contiguous) that :func:`pack` packed into ``packed``."""
    numel = math.prod(shape)
    if packed.dtype != torch.uint8 or packed.numel() != packed_numel(numel):
        raise ValueError(f"unpack: 'packed' must hold {packed_numel(numel)} uint8 bytes for shape "
                         f"{tuple(shape)}, got {packed.numel()} of {packed.dtype}")
    if impl == "numpy" or (impl == "auto" and use_numpy(packed)):
        bits = np.unpackbits(packed.numpy(), count=numel, bitorder="little")
        return torch.from_numpy(bits).view(torch.bool).view(shape)
    if impl == "auto" and _stands_for_numpy(packed):
        return torch.empty(shape, dtype=torch.bool, device=packed.device)  # unpackbits' result
    return _unpack_torch(packed, numel).view(shape)


def _stands_for_numpy(t: torch.Tensor) -> bool:
    """Whether ``t`` is a fake CPU tensor (``slimgrad.estimate``) whose real one numpy would pack or unpack: the
    simulated step then allocates numpy's result alone (real memory, though outside torch's allocator), not the
    torch code's int64 temporaries."""
    if type(t) is torch.Tensor or t.device.type != "cpu" or torch.compiler.is_compiling():
        return False
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t)


def memory_order(t: torch.Tensor) -> tuple[int, ...] | None:
    """The permutation that makes ``t`` contiguous (channels_last, say), or None when it already is or none
    does: the order :func:`pack_planar` packs in, so that its planes follow the memory."""
    if t.is_contiguous():
        return None
    if t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last):
        return (0, 2, 3, 1)
    if t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d):
        return (0, 2, 3, 4, 1)
    strides = t.stride()
    if not all(isinstance(s, int) for s in strides):
        return None  # symbolic strides (dynamic shapes under compile) cannot be sorted: the logical order
    perm = tuple(sorted(range(t.dim()), key=lambda d: -strides[d]))
    return perm if t.permute(perm).is_contiguous() else None


# The planar layout of a feature map on the CPU (see planar_layout): the map read as (pixels, C) rows in
# channels-last order, plane k = rows k*P/8 .. (k+1)*P/8 - 1, so byte (p, c) carries pixel p + k*P/8 in bit k.
PIXEL_PLANES = "pixels"


def planar_layout(t: torch.Tensor):
    """How :func:`pack_planar` lays out the planes of a mask shaped like ``t``: :data:`PIXEL_PLANES` for a
    4-D CPU feature map whose pixel count (numel / C) is a multiple of 8, else the permutation that makes
    ``t`` contiguous (:func:`memory_order`: None for contiguous tensors). (5-D maps keep the flat planes:
    Inductor's channels-last choice for 3-D convolutions was not measured.)

    Why pixels on the CPU: Inductor's layout optimisation turns CNN activations channels-last after the graph
    is traced (always on the CPU with mkldnn), so the memory order the trace sees is not the one the kernels
    run on, and flat planes in the traced order index across the real layout (a div/mod gather per element;
    measured on the width-8 ResNet-18 step, 1.1-1.2x compiled stock). Pixel planes in channels-last order are
    affine rows in that layout: the pack and unpack vectorise over channels, fused into the producing and
    consuming kernels (the same step: 0.95-1.04x stock where slimgrad saves). Other devices keep the flat
    planes in the traced memory order, the format measured there (H100, 1.05-1.14x; pixel planes are not
    measured on a GPU)."""
    if (t.device.type == "cpu" and t.dim() == 4 and t.numel() > 0
            and (t.numel() // t.shape[1]) % 8 == 0):
        return PIXEL_PLANES
    return memory_order(t)


def _pixel_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` (N, C, *spatial) as (pixels, C) rows in channels-last order (a view when ``t`` is channels-last)."""
    return t.permute(0, *range(2, t.dim()), 1).reshape(-1, t.shape[1])


def pack_planar(mask: torch.Tensor, order=None) -> torch.Tensor:
    """Pack a bool ``mask`` of any shape into ``ceil(numel / 8)`` uint8 bytes, in planes: with ``order``
    :data:`PIXEL_PLANES` (see :func:`planar_layout`), into a ``(pixels / 8, C)`` tensor whose bit ``k`` holds
    the ``k``-th eighth of the pixels; otherwise plane ``k`` is elements ``k * M`` to ``k * M + M - 1`` of the mask
    flattened in ``order`` (a permutation of its dimensions, by default the logical order), in bit ``k``.
    Packing in the memory order the traced tensor has (:func:`memory_order`: channels-last activations)
    keeps the planes contiguous in memory. The format for traced graphs (see the module doc); torch ops only,
    so it also runs in eager and on any device.

    The bit arithmetic runs in int32: Inductor's CPU vector code has no native 8-bit shifts (at::vec falls
    back to a scalar loop per vector), which made the mask kernels ~10x the batch-norm kernel they fuse into.

    (Planes along dim 2 of a 4-D map, an outer loop in both layouts Inductor may choose, measured slower on
    the width-8 ResNet-18 step: the zero padding of small maps and the reductions' layouts cost more.)"""
    if order == PIXEL_PLANES:
        rows = _pixel_rows(mask).view(8, -1, mask.shape[1]).to(torch.int32)
        shifts = _shifts(mask.device, torch.int32).view(8, 1, 1)
        packed = (rows << shifts).sum(0, dtype=torch.int32).to(torch.uint8)
        if torch.compiler.is_compiling():
            # Pinned to its (pixels / 8, C) row-major strides: a pack rebuilt in backward otherwise got a
            # channel-major buffer from Inductor, and the batch-norm backward reading it beside channels-last
            # activations ran scalar (measured A/B, compile_speed.py --steps 31: ResNet-18 "all" 1.07 ->
            # 1.03-1.04x compiled stock, "surgical" 1.04-1.05 -> 1.00, VGG-11 "all" 1.09-1.10 -> 1.03-1.04).
            packed = packed.as_strided(packed.shape, packed.stride())
        return packed
    flat = (mask if order is None else mask.permute(order)).reshape(-1)
    numel = flat.numel()
    planes = packed_numel(numel)
    if planes * 8 != numel:
        flat = torch.cat([flat, flat.new_zeros(planes * 8 - numel)])
    shifts = _shifts(mask.device, torch.int32).view(8, 1)
    return (flat.view(8, planes).to(torch.int32) << shifts).sum(0, dtype=torch.int32).to(torch.uint8)


def unpack_planar(packed: torch.Tensor, shape, order=None) -> torch.Tensor:
    """The bool mask of ``shape`` that :func:`pack_planar` packed into ``packed`` in ``order`` (laid out in
    that order: a channels-last mask comes back channels-last)."""
    numel = math.prod(shape)
    if packed.dtype != torch.uint8 or packed.numel() != packed_numel(numel):
        raise ValueError(f"unpack_planar: 'packed' must hold {packed_numel(numel)} uint8 bytes for shape "
                         f"{tuple(shape)}, got {packed.numel()} of {packed.dtype}")
    if order == PIXEL_PLANES:
        shifts = _shifts(packed.device, torch.int32).view(8, 1, 1)
        rows = ((packed.to(torch.int32).unsqueeze(0) >> shifts) & 1 != 0).view(-1, shape[1])
        cl = [shape[0], *shape[2:], shape[1]]
        return rows.view(cl).permute(0, len(shape) - 1, *range(1, len(shape) - 1))
    bits = (packed.to(torch.int32).view(1, -1) >> _shifts(packed.device, torch.int32).view(8, 1)) & 1
    if order is None:
        return bits.view(-1)[:numel].view(shape).to(torch.bool)
    stored = bits.view(-1)[:numel].view([shape[d] for d in order]).to(torch.bool)
    inverse = [0] * len(order)
    for i, d in enumerate(order):
        inverse[d] = i
    return stored.permute(inverse)


_BIT_WEIGHTS = (1, 2, 4, 8, 16, 32, 64, 128)


def pack_vmappable(mask: torch.Tensor) -> torch.Tensor:
    """:func:`pack`'s format (element i in bit i % 8 of byte i // 8, row-major) with ops ``vmap`` batches, for
    the Functions' forwards under torch.func (the int64 view trick of :func:`pack` and numpy cannot run on a
    batched tensor): the mask padded to a multiple of 8, each byte the sum of its bits times their weights."""
    flat = mask.reshape(-1).to(torch.uint8)
    extra = (-flat.shape[0]) % 8
    if extra:
        flat = torch.nn.functional.pad(flat, (0, extra))
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=mask.device)
    return (flat.view(-1, 8) * weights).sum(-1, dtype=torch.uint8)


def unpack_vmappable(packed: torch.Tensor, shape) -> torch.Tensor:
    """The bool mask of ``shape`` that :func:`pack_vmappable` (or :func:`pack`) packed, with ops ``vmap``
    batches."""
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=packed.device)
    return (packed.unsqueeze(-1) & weights).ne(0).reshape(-1)[:math.prod(shape)].view(shape)

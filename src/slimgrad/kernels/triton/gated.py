"""Gated MLP activation ``act(gate) * up`` in Triton (SiLU, exact and tanh GELU, quick GELU).

Forward writes only the output; backward reads gate (and up when gate needs a gradient) and recomputes
``act(gate)`` and its derivative in registers, writing dGate and/or dUp as ``tl.constexpr`` flags say.
The roundings of the references are kept where they decide the result: ``act(gate)`` is rounded to the
input dtype before the product (``F.silu(g) * up``), and mul's backward ``dY·up`` is rounded before the
activation's derivative multiplies it. The activation itself is evaluated in fp32 with Triton's ``exp``
/ ``erf`` (tanh as ``1 - 2/(exp(2z)+1)``), not CUDA's, so agreement is within the dtype's rounding.

Interface (family ``gated_activation``, used by :class:`slimgrad.functional.gated.GatedFunction`):
``supports(gate, kind)``, ``forward(gate, up, kind) -> out``, ``backward(dy, gate, up, kind, need_gate,
need_up) -> (d_gate, d_up)``.
"""

from __future__ import annotations

import torch
import triton.language as tl

from slimgrad.kernels.triton._jit import jit

__all__ = ["backend", "supports", "forward", "backward", "KINDS"]

backend = "triton"
#: Activation names (slimgrad.functional.gated.ACTIVATIONS) -> kernel code. gelu_python and gelu_new are the
#: same functions as gelu and gelu_pytorch_tanh, written in Python ops by transformers.
KINDS = {"silu": 0, "gelu": 1, "gelu_python": 1, "gelu_pytorch_tanh": 2, "gelu_new": 2, "quick_gelu": 3}
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_BLOCK = 1024


@jit
def _forward_kernel(G, U, Y, numel, ACT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    if ACT == 0:
        a = g * tl.sigmoid(g)
    elif ACT == 1:
        a = 0.5 * g * (1.0 + tl.erf(g * 0.7071067811865476))
    elif ACT == 2:
        # tanh(z) = 1 - 2/(exp(2z)+1); |z| clamped at 20 where tanh is ±1 in fp32 (no exp overflow).
        z = tl.minimum(tl.maximum(0.7978845608028654 * (g + 0.044715 * g * g * g), -20.0), 20.0)
        a = 0.5 * g * (2.0 - 2.0 / (tl.exp(2.0 * z) + 1.0))
    else:
        a = g * tl.sigmoid(1.702 * g)
    a = a.to(Y.dtype.element_ty).to(tl.float32)
    tl.store(Y + offs, (a * u).to(Y.dtype.element_ty), mask=mask)


@jit
def _backward_kernel(DY, G, U, DG, DU, numel, ACT: tl.constexpr, BLOCK: tl.constexpr,
                     COMPUTE_DG: tl.constexpr, COMPUTE_DU: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    if ACT == 0:
        s = tl.sigmoid(g)
        a = g * s
        da = s * (1.0 + g * (1.0 - s))
    elif ACT == 1:
        cdf = 0.5 * (1.0 + tl.erf(g * 0.7071067811865476))
        a = g * cdf
        da = cdf + g * tl.exp(-0.5 * g * g) * 0.3989422804014327
    elif ACT == 2:
        z = tl.minimum(tl.maximum(0.7978845608028654 * (g + 0.044715 * g * g * g), -20.0), 20.0)
        t = 1.0 - 2.0 / (tl.exp(2.0 * z) + 1.0)
        a = 0.5 * g * (1.0 + t)
        da = 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * g * g)
    else:
        s = tl.sigmoid(1.702 * g)
        a = g * s
        da = s + 1.702 * g * s * (1.0 - s)
    if COMPUTE_DG:
        u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
        d_act = (dy * u).to(DY.dtype.element_ty).to(tl.float32)
        tl.store(DG + offs, (d_act * da).to(DG.dtype.element_ty), mask=mask)
    if COMPUTE_DU:
        a = a.to(DY.dtype.element_ty).to(tl.float32)
        tl.store(DU + offs, (dy * a).to(DU.dtype.element_ty), mask=mask)


def supports(gate: torch.Tensor, kind: str) -> bool:
    return gate.dtype in _DTYPES and kind in KINDS and gate.numel() > 0


def forward(gate: torch.Tensor, up: torch.Tensor, kind: str) -> torch.Tensor:
    g, u = gate.contiguous(), up.contiguous()
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    numel = g.numel()
    _forward_kernel[(-(-numel // _BLOCK),)](g, u, out, numel, ACT=KINDS[kind], BLOCK=_BLOCK)
    return out


def backward(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor | None, kind: str, need_gate: bool,
             need_up: bool):
    """(d_gate, d_up), each None unless requested; ``up`` is read (and may be None otherwise) only for d_gate."""
    if not (need_gate or need_up):
        return None, None
    g, d = gate.contiguous(), dy.contiguous()
    u = up.contiguous() if need_gate else g
    dg = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device) if need_gate else None
    du = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device) if need_up else None
    numel = g.numel()
    _backward_kernel[(-(-numel // _BLOCK),)](d, g, u, dg if dg is not None else g, du if du is not None else g, numel,
                                            ACT=KINDS[kind], BLOCK=_BLOCK, COMPUTE_DG=need_gate, COMPUTE_DU=need_up)
    return dg, du

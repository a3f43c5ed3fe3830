"""RMSNorm on a GPU, forward and backward timed separately: slimgrad (Llama casting, Triton kernels) vs Hugging
Face's ``LlamaRMSNorm``, ``torch.nn.functional.rms_norm`` and Liger-Kernel's ``LigerRMSNorm``, with the weight
trainable or frozen (LoRA), M rows x H, bf16 and fp32.

    python benchmarks/gpu_norms.py [--rows 2048] [--hidden 1024 2048 4096 8192 16384 32768]
                                   [--dtypes bfloat16 float32] [--out PATH]

Liger is optional: install its wheel without dependencies (``pip install --no-deps --target /tmp/site
liger_kernel-*.whl`` and ``PYTHONPATH=/tmp/site``); it runs with ``in_place=False`` (its default writes dX
into dY, which the other providers do not do and which a repeated backward would corrupt).

"slimgrad split" is the same module with the experimental two-kernel backward (``SPLIT_DW``: dX one program
per row, dW a tiled column reduction), measured to decide whether it should become the default.

Times: ``triton.testing.do_bench``, median (ms); backward re-runs one retained graph. Bytes: "kept" is what
the forward leaves allocated besides its output (the tensors saved for backward), "peak" the highest
allocation above the inputs during one forward + backward (``torch.cuda.max_memory_allocated``). Writes a
Markdown report to ``--out`` (default ``$OUT/gpu_norms.md`` when ``$OUT`` is set, else stdout only).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

import slimgrad

MiB = 1024 * 1024


class TorchRMSNorm(nn.Module):
    """``F.rms_norm`` (aten's fused CUDA kernel when the weight has x's dtype)."""

    def __init__(self, h, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(h))
        self.eps = eps

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def providers(h):
    """name -> module factory (weights ones, eps 1e-6)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    out = {
        "hf LlamaRMSNorm": lambda: LlamaRMSNorm(h, eps=1e-6),
        "F.rms_norm": lambda: TorchRMSNorm(h),
        "slimgrad": lambda: slimgrad.convert(LlamaRMSNorm(h, eps=1e-6)),
        "slimgrad split": lambda: slimgrad.convert(LlamaRMSNorm(h, eps=1e-6)),
    }
    try:
        from liger_kernel.transformers.rms_norm import LigerRMSNorm

        out["liger"] = lambda: LigerRMSNorm(h, eps=1e-6, casting_mode="llama", in_place=False)
    except ImportError as exc:
        print(f"liger_kernel not importable ({exc}); its rows are skipped", file=sys.stderr)
    return out


@contextlib.contextmanager
def split_dw(on: bool):
    """The experimental split backward of slimgrad's RMSNorm kernel (``rms_norm.SPLIT_DW``) on or off."""
    from slimgrad.kernels.triton import rms_norm as kernel

    old = kernel.SPLIT_DW
    kernel.SPLIT_DW = 0 if on else None
    try:
        yield
    finally:
        kernel.SPLIT_DW = old


def measure(make, rows, h, dtype, trainable, device):
    from triton.testing import do_bench

    torch.manual_seed(0)
    module = make().to(device=device, dtype=dtype)
    module.weight.requires_grad_(trainable)
    x = torch.randn(rows, h, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn(rows, h, device=device, dtype=dtype)
    params = [x] + ([module.weight] if trainable else [])
    # Bytes: kept after forward, peak over forward + backward.
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    y = module(x)
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - base - y.numel() * y.element_size()
    y.backward(dy.to(y.dtype))
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    assert (module.weight.grad is not None) == trainable, "a frozen weight got a gradient (or a trainable none)"
    for p in params:
        p.grad = None
    fwd = do_bench(lambda: module(x), return_mode="median")
    y = module(x)
    g = dy.to(y.dtype)
    bwd = do_bench(lambda: y.backward(g, retain_graph=True), grad_to_none=params, return_mode="median")
    return {"fwd": fwd, "bwd": bwd, "kept": kept / MiB, "peak": peak / MiB}


def _ratio(res, a, b):
    """res[a]'s backward time over res[b]'s, formatted ("-" when either is missing)."""
    return f"{res[a]['bwd'] / res[b]['bwd']:.2f}x" if a in res and b in res else "-"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--hidden", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("gpu_norms.py needs a CUDA device")
    device = torch.device("cuda")
    import triton

    name = torch.cuda.get_device_name(device)
    lines = [f"# RMSNorm on {name}", "",
             f"torch {torch.__version__}, triton {triton.__version__}, M = {args.rows} rows; times are "
             f"`triton.testing.do_bench` medians (ms), forward and backward separately; kept = bytes saved "
             f"for backward, peak = highest allocation during forward + backward (MiB).", ""]
    detail = ["| dtype | H | weight | provider | fwd ms | bwd ms | kept MiB | peak MiB |",
              "|---|---|---|---|---|---|---|---|"]
    summary = ["| dtype | H | slimgrad bwd trainable/frozen | liger bwd trainable/frozen | slimgrad vs liger bwd "
               "(frozen) | slimgrad vs liger bwd (trainable) | slimgrad vs F.rms_norm bwd (frozen) | "
               "slimgrad vs HF bwd (frozen) | split vs one-kernel bwd (trainable) | split vs one-kernel bwd "
               "(frozen) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        for h in args.hidden:
            res = {}
            for prov, make in providers(h).items():
                for trainable in (True, False):
                    with split_dw(prov == "slimgrad split"):
                        r = measure(make, args.rows, h, dtype, trainable, device)
                    res[prov, trainable] = r
                    mode = "trainable" if trainable else "frozen"
                    detail.append(f"| {dtype_name} | {h} | {mode} | {prov} | {r['fwd']:.4f} | {r['bwd']:.4f} | "
                                  f"{r['kept']:.1f} | {r['peak']:.1f} |")
                    print(detail[-1], flush=True)
            # "x vs y": y's time / x's time (> 1: x is faster).
            summary.append(f"| {dtype_name} | {h} | {_ratio(res, ('slimgrad', True), ('slimgrad', False))} | "
                           f"{_ratio(res, ('liger', True), ('liger', False))} | "
                           f"{_ratio(res, ('liger', False), ('slimgrad', False))} | "
                           f"{_ratio(res, ('liger', True), ('slimgrad', True))} | "
                           f"{_ratio(res, ('F.rms_norm', False), ('slimgrad', False))} | "
                           f"{_ratio(res, ('hf LlamaRMSNorm', False), ('slimgrad', False))} | "
                           f"{_ratio(res, ('slimgrad', True), ('slimgrad split', True))} | "
                           f"{_ratio(res, ('slimgrad', False), ('slimgrad split', False))} |")
    lines += ["## Backward speed ratios", "", "Trainable/frozen: how much faster slimgrad's backward is with the "
              "weight frozen. \"slimgrad vs X\": X's backward time / slimgrad's (> 1: slimgrad faster).", "",
              *summary, "", "## All measurements", "", *detail, ""]
    text = "\n".join(lines)
    print(text)
    out = args.out or (os.path.join(os.environ["OUT"], "gpu_norms.md") if os.environ.get("OUT") else None)
    if out:
        with open(out, "w") as f:
            f.write(text)
        print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()

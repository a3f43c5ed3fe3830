"""Forward+backward time and bytes kept for backward: slimgrad norms vs Hugging Face LlamaRMSNorm, torch's
nn.RMSNorm and nn.LayerNorm, with the weight trainable or frozen (LoRA-style).

    python benchmarks/norms.py [--device cuda] [--rows 2048] [--hidden 1024 4096 16384 32768] [--repeats 10]

Prints a Markdown table and writes docs/norms.md. Timings are medians of interleaved runs (each repeat runs
every variant once, in turn), so drift on a shared machine hits all variants alike.
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import sys
import time

import torch
from torch import nn

import slimgrad  # noqa: F401
from slimgrad.measure import saved_bytes
from slimgrad.nn.norms import LayerNorm, RMSNorm

try:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from slimgrad._registry import REPLACEMENTS
    from slimgrad.integrations import hf_norms  # noqa: F401
except ImportError:  # transformers is optional
    LlamaRMSNorm = None


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step(module, x, g):
    y = module(x)
    y.backward(g)


def _variants(hidden, dtype, device):
    out = {}
    if LlamaRMSNorm is not None:
        hf = LlamaRMSNorm(hidden).to(device=device, dtype=dtype)
        slim = copy.deepcopy(hf)
        slim.__class__ = REPLACEMENTS[LlamaRMSNorm]
        out["LlamaRMSNorm"] = (hf, slim)
    rms = nn.RMSNorm(hidden, device=device, dtype=dtype)
    slim = copy.deepcopy(rms)
    slim.__class__ = RMSNorm
    out["nn.RMSNorm"] = (rms, slim)
    ln = nn.LayerNorm(hidden, device=device, dtype=dtype)
    slim = copy.deepcopy(ln)
    slim.__class__ = LayerNorm
    out["nn.LayerNorm"] = (ln, slim)
    return out


def run(args):
    device = torch.device(args.device)
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for hidden in args.hidden:
            gen = torch.Generator(device="cpu").manual_seed(0)
            x = torch.randn(args.rows, hidden, generator=gen).to(device=device, dtype=dtype).requires_grad_()
            g = torch.randn(args.rows, hidden, generator=gen).to(device=device, dtype=dtype)
            for name, (stock, slim) in _variants(hidden, dtype, device).items():
                for frozen in (False, True):
                    for m in (stock, slim):
                        for p in m.parameters():
                            p.requires_grad_(not frozen)
                    kept = {k: saved_bytes(m, x) for k, m in (("stock", stock), ("slim", slim))}
                    times = {"stock": [], "slim": []}
                    for _ in range(2):  # warm-up
                        _step(stock, x, g)
                        _step(slim, x, g)
                    for r in range(args.repeats):
                        # the order alternates: the second of two runs on fresh 100+ MiB tensors can pay for the
                        # first's page faults (a fixed order once showed a frozen LayerNorm, stock's own op, 0.58x)
                        pair = (("stock", stock), ("slim", slim))
                        for k, m in (pair if r % 2 == 0 else pair[::-1]):
                            _sync(device)
                            t0 = time.perf_counter()
                            _step(m, x, g)
                            _sync(device)
                            times[k].append(time.perf_counter() - t0)
                    x.grad = None
                    for m in (stock, slim):
                        m.zero_grad(set_to_none=True)
                    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
                    rows.append((name, str(dtype).replace("torch.", ""), hidden, "frozen" if frozen else "trainable",
                                 med["stock"], med["slim"], kept["stock"] / 2**20, kept["slim"] / 2**20))
                    print(_fmt(rows[-1]), flush=True)
    return rows


HEADER = ("| module | dtype | H | weight | stock ms | slimgrad ms | speed-up | stock MiB kept | slimgrad MiB kept |\n"
          "|---|---|---:|---|---:|---:|---:|---:|---:|")


def _fmt(r):
    name, dtype, hidden, w, ts, tm, ks, km = r
    return (f"| {name} | {dtype} | {hidden} | {w} | {ts:.2f} | {tm:.2f} | {ts / tm:.2f}x | {ks:.1f} | "
            f"{km:.1f} |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--rows", type=int, default=2048)
    p.add_argument("--hidden", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "docs", "norms.md"))
    args = p.parse_args(argv)
    print(HEADER)
    rows = run(args)
    machine = (torch.cuda.get_device_name(args.device) if args.device.startswith("cuda")
               else f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads")
    cmd = "python " + " ".join(["benchmarks/norms.py"] + (argv if argv is not None else sys.argv[1:]))
    text = DOC.format(cmd=cmd, torch=torch.__version__, machine=machine, rows=args.rows, repeats=args.repeats,
                      table="\n".join([HEADER] + [_fmt(r) for r in rows]))
    with open(args.out, "w") as f:
        f.write(text)
    print(f"wrote {os.path.normpath(args.out)}")


DOC = """# Normalisation layers

`slimgrad.nn.RMSNorm`, `LayerNorm`, `GroupNorm` (drop-ins for torch's), the Hugging Face RMSNorms
(converted by `slimgrad.convert` when transformers is loaded), and two layers with no stock counterpart,
`FusedAddRMSNorm` (`(norm(x + r), x + r)`) and `PolyNorm`.

## What is kept for backward

| layer | reference keeps | slimgrad keeps |
|---|---|---|
| HF LlamaRMSNorm (~140 copies), bf16 | fp32 copy of x, rstd, bf16 x̂ (W trains) | x (bf16) + fp32 rstd |
| HF LlamaRMSNorm, only W trains | x̂ in bf16 | x̂ in bf16 (the same) |
| HF Gemma/Gemma2/Gemma3, Olmo2 RMSNorm, bf16 | fp32 copy of x, rstd, fp32 x̂ | x (bf16) + rstd |
| T5LayerNorm, bf16 | fp32 copy of x, x, rstd, x̂ | x + rstd |
| nn.RMSNorm (CPU decomposition), bf16 | fp32 copy of x, rstd, fp32 x̂ | x (bf16) + rstd |
| nn.LayerNorm / nn.GroupNorm, only bias trains | x, mean, rstd | nothing |
| FusedAddRMSNorm | (no reference) | x + r, rstd |
| PolyNorm | (reference: 3 powers, 3 normalised copies in fp32) | x + 3 rstd per row |

Frozen weights: the weight's gradient is never computed (RMSNorm skips the product and the row
reduction; LayerNorm/GroupNorm pass stock's `output_mask` with dW off). fp64 inputs to the fp32 styles
(Llama, Olmo2, Gemma) are kept as their fp32 copy, which is all those references read.

## Exactness
RMSNorm (every style) replays autograd's backward of the reference op for op, so outputs and gradients
are bitwise equal on CPU in fp32, fp64, bf16 and fp16 (tested per class). Where the reference's formula
gives x two gradients (x feeds both the square and the product: T5 always, the other styles when x is
already in the statistics' dtype, e.g. fp32), slimgrad hands both over apart (x goes into its Function
twice) rather than their sum, so a residual that reads the same x (every decoder layer) gets
`(residual + product's) + square's` as stock does: whole-model training steps of Llama and T5 are bitwise
(`tests/test_hf_norms.py::test_whole_model_training_steps_are_bitwise`). Under `torch.compile` the sum goes
over (dynamo refuses one tensor passed twice): within rounding there. The backward frees each temporary
after its last use; a step's peak is at or below stock's where the core's one-pass kernels run (CPU, fp32,
bf16, fp16), and otherwise at most a few per-row statistics above it
(`tests/test_hf_norms.py::test_input_that_also_feeds_a_residual`). LayerNorm and GroupNorm call
stock's kernels (bitwise). On CUDA `torch.rms_norm` runs the fused kernel; so does slimgrad (with stock's
`output_mask`). PolyNorm's forward is bitwise the formula; its backward is analytic (fp32 rounding).

## Found on the way
torch 2.13's channels-last GroupNorm CPU backward segfaults when the input's gradient is not requested
(frozen backbone, GroupNorm weight or bias training): its kernel writes dX unconditionally. slimgrad runs
the contiguous kernel there.

## Benchmark
`{cmd}` — torch {torch}, {machine}; M = {rows} rows, forward + backward, median of {repeats} interleaved
runs; MiB kept for backward by one forward (saved-tensor hooks, parameters excluded).

{table}

Reading the figures: "frozen" freezes every parameter (input gradient only). On CPU the RMSNorms run the
compiled core's one-pass kernels (csrc/norms.cpp): slimgrad rebuilds x·rstd from x instead of keeping it and still
runs faster than the decomposed references, which make a pass and a temporary per op, for 1/3 (bf16, W trains)
to 1/2 of the bytes kept. LayerNorm runs stock's own op where it saves nothing (these rows); its saving appears
only when the bias alone trains (tested in tests/test_norms.py). The order of the two runs alternates between
repeats. The CPU figures come from a 2-core machine shared with other jobs: treat differences under ~10% as noise.
"""


if __name__ == "__main__":
    main()

"""CUDA bytes kept, peak memory and step time of the MemSave CNN cases, stock vs slimgrad.

    python benchmarks/gpu_memory.py [--model resnet18] [--batch 32] [--size 224] [--repeats 20] [--out PATH]

Per case: bytes kept for backward on the GPU (saved-tensor hooks, parameters excluded), the same ratio
measured on the CPU (batch 2, same image size: kept bytes scale with the batch) to check that the GPU keeps
what the CPU path keeps, ``torch.cuda.max_memory_allocated`` above the model's own footprint over one
training step, and step time (CUDA events around forward + backward; median of interleaved pairs, with the
median of the pair-by-pair ratios). Without CUDA it says so and exits 0, so it can sit in scripts that also
run on CPU machines. ``--out`` also writes the table as markdown.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys

import torch

import slimgrad
from slimgrad.cases import CASES, apply_case
from slimgrad.measure import SavedTensors
from slimgrad.models.cnn import build_model

MiB = 2**20


def step(model, x, input_grad):
    model.zero_grad(set_to_none=True)
    out = model(x.detach().requires_grad_(input_grad))
    out.float().sum().backward()


def kept(model, x, input_grad):
    step(model, x, input_grad)  # warm-up: ReLUs learn whether their consumer keeps their output
    model.zero_grad(set_to_none=True)
    with SavedTensors(exclude=[model]) as counter:
        out = model(x.detach().requires_grad_(input_grad))
    out.float().sum().backward()
    return counter.bytes


def peak(model, x, input_grad, device):
    step(model, x, input_grad)  # warm-up: cuDNN autotuning, allocator pools
    torch.cuda.synchronize(device)
    model.zero_grad(set_to_none=True)
    start = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step(model, x, input_grad)
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - start


def timed(model, x, input_grad, device):
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    step(model, x, input_grad)
    end.record()
    torch.cuda.synchronize(device)
    return begin.elapsed_time(end)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    parser.add_argument("--out", help="also write the table as markdown to this path")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_memory: no CUDA device here; nothing to measure (CPU figures: python -m slimgrad demo)")
        return 0
    device = torch.device("cuda")
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    x = torch.randn(args.batch, 3, args.size, args.size, device=device, dtype=dtype)
    x_cpu = torch.randn(2, 3, args.size, args.size, dtype=dtype)
    title = (f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, {args.model}, input "
             f"{tuple(x.shape)} {args.dtype}; kept and peak in MiB, time: median ms/step of {args.repeats} "
             f"interleaved pairs")
    header = ("| case | stock kept | slimgrad kept | kept ratio (GPU) | kept ratio (CPU) | stock peak | "
              "slimgrad peak | peak ratio | stock ms | slimgrad ms | time ratio |")
    lines = [title, "", header, "|" + "---|" * 11]
    print(title)
    for case in args.cases:
        stock = build_model(args.model).to(device, dtype)
        input_grad = apply_case(stock, case)
        slim = slimgrad.convert(copy.deepcopy(stock))
        kept_gpu = [kept(m, x, input_grad) for m in (stock, slim)]
        cpu_models = [copy.deepcopy(m).cpu() for m in (stock, slim)]
        kept_cpu = [kept(m, x_cpu, input_grad) for m in cpu_models]
        del cpu_models
        peaks = [peak(m, x, input_grad, device) for m in (stock, slim)]
        times, ratios = ([], []), []
        for i in range(args.repeats):
            order = (0, 1) if i % 2 == 0 else (1, 0)
            pair = {}
            for j in order:
                pair[j] = timed((stock, slim)[j], x, input_grad, device)
                times[j].append(pair[j])
            ratios.append(pair[1] / pair[0])
        ms = [statistics.median(t) for t in times]
        row = (f"| {case} | {kept_gpu[0] / MiB:.1f} | {kept_gpu[1] / MiB:.1f} | {kept_gpu[1] / kept_gpu[0]:.3f} | "
               f"{kept_cpu[1] / kept_cpu[0]:.3f} | {peaks[0] / MiB:.1f} | {peaks[1] / MiB:.1f} | "
               f"{peaks[1] / peaks[0]:.3f} | {ms[0]:.2f} | {ms[1]:.2f} | {statistics.median(ratios):.3f} |")
        print(row, flush=True)
        lines.append(row)
        del stock, slim
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

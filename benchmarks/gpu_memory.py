"""CUDA peak memory and step time of the MemSave CNN cases, stock vs slimgrad.

    python benchmarks/gpu_memory.py [--model resnet18] [--batch 8] [--size 224] [--repeats 5]

Reports ``torch.cuda.max_memory_allocated`` above the model's own footprint over one training step
(forward + backward) and the median step time of interleaved runs. Without CUDA it says so and exits 0,
so it can sit in scripts that also run on CPU machines.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys

import torch

import slimgrad
from slimgrad.cases import CASES, apply_case
from slimgrad.models.cnn import build_model


def step(model, x, input_grad):
    model.zero_grad(set_to_none=True)
    out = model(x.detach().requires_grad_(input_grad))
    out.float().sum().backward()


def measure(model, x, input_grad, device):
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
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_memory: no CUDA device here; nothing to measure (CPU figures: python -m slimgrad demo)")
        return 0
    device = torch.device("cuda")
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    x = torch.randn(args.batch, 3, args.size, args.size, device=device, dtype=dtype)
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, {args.model}, input "
          f"{tuple(x.shape)} {args.dtype}; MiB above the model, median ms/step of {args.repeats}")
    print(f"{'case':15s} {'stock MiB':>10s} {'slim MiB':>10s} {'ratio':>6s} {'stock ms':>9s} {'slim ms':>9s}")
    for case in CASES:
        stock = build_model(args.model).to(device, dtype)
        input_grad = apply_case(stock, case)
        slim = slimgrad.convert(copy.deepcopy(stock))
        peaks = [measure(m, x, input_grad, device) for m in (stock, slim)]
        times = ([], [])
        for _ in range(args.repeats):
            for i, m in enumerate((stock, slim)):
                times[i].append(timed(m, x, input_grad, device))
        ms = [statistics.median(t) for t in times]
        print(f"{case:15s} {peaks[0] / 2**20:10.1f} {peaks[1] / 2**20:10.1f} {peaks[1] / peaks[0]:6.3f} "
              f"{ms[0]:9.2f} {ms[1]:9.2f}")
        del stock, slim
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())

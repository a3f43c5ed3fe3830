"""transformers' MobileNetV2 with frozen weights and batch norm in eval (only the input needs grad): what
stock keeps, what slimgrad kept before it knew ReLU6 (every ReLU6 excluded from conversion) and what it
keeps now (ReLU6 as a 1-bit mask), with peaks over a step and step times.

    python benchmarks/mobilenet_input.py --batch-size 8 --image-size 224 --repeats 5

Times are medians of interleaved runs (stock, slimgrad, stock, ...), so machine noise hits both alike.
Writes its table to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
from _docs import write_section
from torch import nn
from transformers import MobileNetV2Config, MobileNetV2Model

import slimgrad
from slimgrad.measure import SavedTensors, peak_bytes

MIB = 2**20


def step(model, x):
    model(x.detach().requires_grad_()).last_hidden_state.float().sum().backward()


def kept(model, x):
    xi = x.detach().requires_grad_()
    with SavedTensors(exclude=[model]) as counter:
        out = model(xi).last_hidden_state
    out.float().sum().backward()
    return counter.bytes


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-docs", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    stock = MobileNetV2Model(MobileNetV2Config(image_size=args.image_size)).eval()
    stock.requires_grad_(False)
    x = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
    models = {"stock": stock, "slimgrad without ReLU6 masks": slimgrad.convert(stock, exclude=[nn.ReLU6]),
              "slimgrad": slimgrad.convert(stock)}
    rows = {}
    for name, model in models.items():
        kept(model, x)  # first step: producers learn what their consumers keep
        rows[name] = [kept(model, x), peak_bytes(step, model, x)]
    times = {name: [] for name in models}
    for _ in range(args.repeats + 1):
        for name, model in models.items():
            t0 = time.perf_counter()
            step(model, x)
            times[name].append(time.perf_counter() - t0)
    base = rows["stock"][0]
    lines = ["| | MiB kept | of stock | peak MiB | step ms |", "|---|---:|---:|---:|---:|"]
    for name, (k, peak) in rows.items():
        ms = statistics.median(times[name][1:]) * 1e3
        lines.append(f"| {name} | {k / MIB:.1f} | {k / base:.3f} | {peak / MIB:.1f} | {ms:.0f} |")
    table = "\n".join(lines)
    print(table)
    if not args.no_docs:
        write_section("mobilenet_input", (
            f"## MobileNetV2, only the input needs grad (frozen weights, batch norm in eval)\n\n"
            f"`python benchmarks/mobilenet_input.py --batch-size {args.batch_size} --image-size {args.image_size} "
            f"--repeats {args.repeats}` (torch {torch.__version__}, {platform.machine()}, "
            f"{torch.get_num_threads()} threads; times: medians of interleaved runs):\n\n{table}"))


if __name__ == "__main__":
    main()

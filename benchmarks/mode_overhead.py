"""Run-time cost of ``slimgrad.enabled()`` against ``convert`` and stock, on a ResNet-18-like CNN.

    python benchmarks/mode_overhead.py [--batch 8] [--size 128] [--repeats 7]

Every torch call inside ``enabled()`` goes through a Python ``__torch_function__``, rerouted or not; this
measures what that costs per training step (forward + backward), as the median of interleaved runs so that
machine load drifts hit every variant alike.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import slimgrad
from slimgrad.mode import enabled
from slimgrad.models.cnn import resnet18


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = resnet18(num_classes=10)
    variants = {"stock": (copy.deepcopy(model), None), "convert": (slimgrad.convert(model), None),
                "enabled": (copy.deepcopy(model), enabled)}
    x = torch.randn(args.batch, 3, args.size, args.size)

    def step(m, ctx):
        m.zero_grad(set_to_none=True)
        if ctx is None:
            out = m(x)
        else:
            with ctx():
                out = m(x)
        out.sum().backward()

    times = {k: [] for k in variants}
    for m, ctx in variants.values():
        step(m, ctx)  # warm-up
    for _ in range(args.repeats):
        for name, (m, ctx) in variants.items():
            t = time.perf_counter()
            step(m, ctx)
            times[name].append(time.perf_counter() - t)
    base = statistics.median(times["stock"])
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, input {tuple(x.shape)}, "
          f"all parameters train, {args.repeats} interleaved repeats")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:8s} median {med * 1e3:8.1f} ms/step  ({med / base:.3f}x stock)")


if __name__ == "__main__":
    main()

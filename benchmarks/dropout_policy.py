"""Dropout on CPU under each policy: stock's ``F.dropout``, slimgrad's ``bits`` (stock's draw, 1 bit kept) and
``seed`` (8 bytes kept, the Philox mask regenerated in backward) through the compiled core, and ``seed`` through the
torch reference (the core off), forward + backward of one call.

    OMP_NUM_THREADS=1 python benchmarks/dropout_policy.py [--shape 4,128,512] [--rounds 30]

The thread's CPU time, median of interleaved rounds (the reference, ~35x slower, runs a fifth as many); prints a
markdown table. docs/benchmarks.md quotes it ("Dropout policy").
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from slimgrad import csrc
from slimgrad.functional.dropout import dropout


def _step(x0, g, fn):
    x = x0.clone().requires_grad_()
    start = time.thread_time()
    fn(x).backward(g)
    return time.thread_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="4,128,512")
    parser.add_argument("--p", type=float, default=0.1)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    shape = tuple(int(s) for s in args.shape.split(","))
    x0 = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    g = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    p = args.p
    cases = {"stock F.dropout": lambda x: F.dropout(x, p, True),
             "bits (core)": lambda x: dropout(x, p, policy="bits"),
             "seed (core)": lambda x: dropout(x, p, policy="seed")}
    times: dict[str, list[float]] = {name: [] for name in cases}
    times["seed (torch reference, core off)"] = []
    for r in range(args.rounds):
        for name, fn in cases.items():
            times[name].append(_step(x0, g, fn))
        if r % 5 == 0:
            with csrc.disabled():
                times["seed (torch reference, core off)"].append(_step(x0, g, cases["seed (core)"]))
    print(f"`OMP_NUM_THREADS={torch.get_num_threads()} python benchmarks/dropout_policy.py --shape {args.shape} "
          f"--rounds {args.rounds}` — torch {torch.__version__}, {platform.machine()}, {torch.get_num_threads()} "
          f"thread(s), core {'loaded' if csrc.core() is not None else 'unavailable'}; p = {p}, forward + backward\n")
    print("| dropout | ms |\n|---|---:|")
    for name, values in times.items():
        print(f"| {name} | {statistics.median(values) * 1e3:.2f} |")


if __name__ == "__main__":
    main()

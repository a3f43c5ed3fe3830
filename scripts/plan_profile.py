"""Where one ``slimgrad.plan`` call spends its time (issue 23: the budget benchmark's plan searches took 76 s of the
Llama's section on an H100 host, against seconds on CPU). One plan of the budget benchmark's Llama (4 layers, seq
128, batch 8, converted) at 50 % of its estimated peak, under cProfile; the statistics are printed when the plan
ends or when the process is stopped (SIGTERM, e.g. by ``timeout``), so a bounded GPU run always reports them.

    python scripts/plan_profile.py [--device cuda] [--top 35]
"""

import argparse
import cProfile
import pstats
import signal
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import budget  # noqa: E402

import slimgrad  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--top", type=int, default=35)
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(1)
    work = budget.Llama(False)
    model = slimgrad.convert(work.build(device))
    batch = work.batch(work.ref, device)
    t = time.perf_counter()
    peak = slimgrad.estimate(model, **batch).peak_bytes
    print(f"one estimate: {time.perf_counter() - t:.2f} s, peak {peak} B", flush=True)

    profile = cProfile.Profile()
    started = time.perf_counter()

    def report(*_):
        profile.disable()
        print(f"plan: {time.perf_counter() - started:.1f} s (profiled)", flush=True)
        pstats.Stats(profile, stream=sys.stdout).sort_stats("cumulative").print_stats(args.top)
        sys.stdout.flush()
        sys.exit(0)

    signal.signal(signal.SIGTERM, report)
    profile.enable()
    plan = slimgrad.plan(model, int(peak * 0.5), batch)
    print(plan.fits, {c.path: c.action for c in plan.blocks if c.action != "keep"})
    report()


if __name__ == "__main__":
    main()

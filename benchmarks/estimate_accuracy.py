"""How close ``slimgrad.estimate`` is to the allocator's own records, on the models users train.

    OMP_NUM_THREADS=1 python benchmarks/estimate_accuracy.py [--only llama,resnet] [--write]

For every model of benchmarks/speed.py (small configs, random weights) and a stock and a converted copy,
without and with an AdamW optimizer: ``slimgrad.estimate`` (one step simulated on fake tensors) against the
peak measured around a real step (``slimgrad.peak_bytes``: the profiler's memory records on CPU,
``max_memory_allocated`` on CUDA). With the optimizer, the measured step is the steady state: two real
training steps first, then zero_grad + forward + backward + ``step()`` measured. Both figures are above the
step's start (parameters, buffers, inputs and optimizer state existing before the step are not counted).
``--write`` puts the table into docs/estimate.md with the command, torch version and machine.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import sys
import time

import torch
from _docs import write_section
from speed import ROWS, _inputs, _to

import slimgrad

MiB = 2**20
DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "estimate.md"


def _call(model, batch, key):
    """(args, kwargs) of the model call the row's loss makes."""
    if key in ("t5", "llama"):
        return (), {"input_ids": batch, "labels": batch}
    if isinstance(batch, dict):
        return (), batch
    return (batch,), {}


def measure(build, case, key, optimizer: bool, convert: bool, device: torch.device):
    torch.manual_seed(0)
    model, batch, loss, input_grad = build(case)
    model, batch = model.to(device), _to(batch, device)
    if convert:
        model = slimgrad.convert(model)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4) if optimizer and params else None

    def step():
        if opt is not None:
            opt.zero_grad(set_to_none=True)
        loss(model, _inputs(batch, input_grad)).backward()
        if opt is not None:
            opt.step()

    step()
    step()  # warm: the converted layers learn their consumers, the optimizer makes its state
    for p in model.parameters():
        p.grad = None
    measured = slimgrad.peak_bytes(step)
    for p in model.parameters():
        p.grad = None
    args, kwargs = _call(model, _inputs(batch, input_grad), key)
    started = time.perf_counter()
    est = slimgrad.estimate(model, *args, optimizer=opt, **kwargs)
    seconds = time.perf_counter() - started
    return est, measured, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    keys = ",".join(sorted({r[3] for r in ROWS if r[3] not in ("noise", "vae")}))
    parser.add_argument("--only", default="", help=f"comma-separated row keys: {keys}")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda where a GPU is lent")
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--out", default=str(DOC), help="the markdown file --write updates")
    parser.add_argument("--time-limit", type=float, default=0.0,
                        help="seconds: start no row after this (a lent GPU's bounded run); the table says so")
    args = parser.parse_args()
    device = torch.device(args.device)
    only = {k for k in args.only.split(",") if k}
    rows = [r for r in ROWS if r[3] not in ("noise", "vae") and (not only or r[3] in only)]
    # without the optimizer first, so that a run cut short by --time-limit covers every model
    jobs = [(r, opt, conv) for opt in (False, True) for r in rows for conv in (False, True)]
    results = []
    started = time.perf_counter()
    for n, ((name, case, build, key), opt, conv) in enumerate(jobs, 1):
        if args.time_limit and time.perf_counter() - started > args.time_limit:
            break
        done = int(30 * (n - 1) / len(jobs))
        print(f"\r[{'#' * done}{'.' * (30 - done)}] {n}/{len(jobs)} {name} / {case} "
              f"({time.perf_counter() - started:.0f} s)" + " " * 20, end="", file=sys.stderr, flush=True)
        try:
            results.append((name, case, opt, conv, measure(build, case, key, opt, conv, device)))
        except Exception as exc:  # noqa: BLE001 - report the row and go on
            results.append((name, case, opt, conv, f"{type(exc).__name__}: {exc}"))
    print(f"\r[{'#' * 30}] done in {time.perf_counter() - started:.0f} s" + " " * 60, file=sys.stderr)

    cmd = "python benchmarks/estimate_accuracy.py " + " ".join(sys.argv[1:])
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    if device.type == "cuda":
        machine = f"{torch.cuda.get_device_name(device)}, {machine}"
    records = ("the profiler's memory records" if device.type == "cpu"
               else "`torch.cuda.max_memory_allocated`")
    errors = [abs(r[4][0].step_peak_bytes - r[4][1]) / r[4][1] for r in results if not isinstance(r[4], str)]
    lines = [
        "## Estimate against the allocator's records" + ("" if device.type == "cpu" else f" ({device.type})"),
        "",
        f"`OMP_NUM_THREADS=1 {cmd.strip()}` — torch {torch.__version__}, {machine}, "
        f"{time.strftime('%Y-%m-%d')}. Peak over one training step above its start: `slimgrad.estimate` "
        f"(simulated on fake tensors) against `slimgrad.peak_bytes` around the real step ({records}). "
        + (f"Stopped by `--time-limit` after {len(results)} of {len(jobs)} rows. " if len(results) < len(jobs)
           else "")
        + f"Largest error over {len(errors)} rows: "
        f"**{100 * max(errors, default=0):.2f} %**.",
        "",
        "| model | case | optimizer | model as | estimated MiB | measured MiB | error | peak at | estimate s |",
        "|---|---|---|---|---:|---:|---:|---|---:|",
    ]
    for name, case, opt, conv, r in results:
        label = ("AdamW" if opt else "none", "converted" if conv else "stock")
        if isinstance(r, str):
            lines.append(f"| {name} | {case} | {label[0]} | {label[1]} | – | – | error: {r[:80]} | | |")
            continue
        est, measured, seconds = r
        where = est.peak_where.replace("|", "/")
        lines.append(f"| {name} | {case} | {label[0]} | {label[1]} | {est.step_peak_bytes / MiB:.2f} | "
                     f"{measured / MiB:.2f} | {100 * (est.step_peak_bytes - measured) / measured:+.2f} % | "
                     f"{where[:70]} | {seconds:.1f} |")
    text = "\n".join(lines)
    print(text)
    if args.write:
        write_section("estimate-accuracy" + ("" if device.type == "cpu" else f"-{device.type}"), text,
                      pathlib.Path(args.out))


if __name__ == "__main__":
    main()

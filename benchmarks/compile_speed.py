"""Step time under torch.compile (Inductor, default layout): compiled slimgrad against compiled stock on the
in-repo CNNs, per memsave case, interleaved steps (stock, slimgrad, stock, ...) so that load on a shared
machine hits both alike; median and the ratio, with the bytes each compiled step keeps.

    OMP_NUM_THREADS=1 python benchmarks/compile_speed.py --model resnet18 --width-scale 0.125 --batch-size 4
    python benchmarks/compile_speed.py --device cuda --width-scale 1 --batch-size 32 --image-size 224
    OMP_NUM_THREADS=1 python benchmarks/compile_speed.py --lora [--lora-dropout 0.1]
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
from _docs import write_section  # benchmarks/ is on sys.path when run as a script
from compile_bytes import add_arguments, lora_model

import slimgrad
from slimgrad.cases import apply_case
from slimgrad.measure import SavedTensors
from slimgrad.models.cnn import build_model

try:
    from tqdm import tqdm
except ImportError:  # pragma: no cover - tqdm ships with the dev extra
    def tqdm(it, **_):
        return it


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_case(base, x, case, args):
    model = copy.deepcopy(base)
    needs_x = apply_case(model, case)
    compiled = {}
    for name, slim in (("stock", False), ("slimgrad", True)):
        m = copy.deepcopy(model)
        compiled[name] = torch.compile(slimgrad.convert(m) if slim else m, fullgraph=True)

    def step(run):
        xi = x.clone(memory_format=torch.preserve_format).requires_grad_(needs_x)
        run(xi).sum().backward()

    kept = {}
    for name, run in compiled.items():
        step(run)  # compile
        step(run)
        with SavedTensors(exclude=[run]) as counter:
            out = run(x.clone(memory_format=torch.preserve_format).requires_grad_(needs_x))
        out.sum().backward()
        kept[name] = counter.bytes / 2**20
    times = {name: [] for name in compiled}
    for _ in tqdm(range(args.steps), desc=case, leave=False, file=sys.stderr):
        for name, run in compiled.items():
            _sync(x.device)
            t0 = time.perf_counter()
            step(run)
            _sync(x.device)
            times[name].append(time.perf_counter() - t0)
    torch._dynamo.reset()
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    return med, kept


def run_lora(args):
    """The LoRA step of compile_bytes.py (peft on a Llama-like bf16 model), stock and slimgrad compiled
    (HF's forward has graph breaks: not fullgraph), interleaved."""

    model, ids = lora_model(args.lora_dropout)
    compiled = {"stock": torch.compile(copy.deepcopy(model).train()),
                "slimgrad": torch.compile(slimgrad.convert(copy.deepcopy(model).train()))}

    def step(run):
        run(input_ids=ids, labels=ids).loss.backward()

    kept = {}
    for name, run in compiled.items():
        step(run)
        step(run)
        with SavedTensors(exclude=[run]) as counter:
            out = run(input_ids=ids, labels=ids)
        out.loss.backward()
        kept[name] = counter.bytes / 2**20
    times = {name: [] for name in compiled}
    for _ in tqdm(range(args.steps), desc="lora", leave=False, file=sys.stderr):
        for name, run in compiled.items():
            t0 = time.perf_counter()
            step(run)
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}, kept


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)  # the model and case options of compile_bytes.py (--lora: its LoRA step, on CPU)
    parser.add_argument("--steps", type=int, default=15, help="interleaved timed steps per provider")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--channels-last", action="store_true", help="model and input in channels_last")
    args = parser.parse_args()
    lines = []

    def emit(line):
        print(line, flush=True)
        lines.append(line)

    header = ("| case | stock compiled ms | slimgrad compiled ms | ratio | stock compiled MiB kept | "
              "slimgrad compiled MiB kept |\n|---|---:|---:|---:|---:|---:|")
    if args.lora:
        med, kept = run_lora(args)
        key = f"lora_dropout{args.lora_dropout:g}"
        emit(f"torch {torch.__version__}, cpu, threads {torch.get_num_threads()}; LoRA step "
             f"(lora_dropout={args.lora_dropout}), median of {args.steps} interleaved steps")
        emit(header)
        emit(f"| lora | {med['stock']:.2f} | {med['slimgrad']:.2f} | {med['slimgrad'] / med['stock']:.2f} | "
             f"{kept['stock']:.3f} | {kept['slimgrad']:.3f} |")
    else:
        device = torch.device(args.device)
        torch.manual_seed(0)
        base = build_model(args.model, width_scale=args.width_scale, num_classes=10).to(device)
        x = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device)
        if args.channels_last:
            base = base.to(memory_format=torch.channels_last)
            x = x.contiguous(memory_format=torch.channels_last)
        where = (torch.cuda.get_device_name() if device.type == "cuda"
                 else platform.processor() or platform.machine())
        key = f"{args.model}_{device.type}{'_cl' if args.channels_last else ''}"
        emit(f"torch {torch.__version__}, {device.type} ({where}), threads {torch.get_num_threads()}; "
             f"{args.model} width {args.width_scale}, {args.batch_size}x3x{args.image_size}^2"
             f"{' channels_last' if args.channels_last else ''}, "
             f"median of {args.steps} interleaved steps")
        emit(header)
        for case in args.cases.split(","):
            med, kept = run_case(base, x, case, args)
            emit(f"| {case} | {med['stock']:.2f} | {med['slimgrad']:.2f} | {med['slimgrad'] / med['stock']:.2f} | "
                 f"{kept['stock']:.3f} | {kept['slimgrad']:.3f} |")
    threads = os.environ.get("OMP_NUM_THREADS")
    command = (f"{'OMP_NUM_THREADS=' + threads + ' ' if threads else ''}python benchmarks/compile_speed.py "
               f"{' '.join(sys.argv[1:])}").strip()
    write_section(f"compile_speed_{key}", f"## Compiled step time: {key}\n\n`{command}`\n\n{lines[0]}\n\n"
                  + "\n".join(lines[1:]))


if __name__ == "__main__":
    main()

"""MemSave's evaluation on the in-repo CNNs: bytes kept, peak bytes and step time, four providers.

Providers: stock eager, torch.compile, slimgrad, slimgrad + torch.compile, on the same model weights and
inputs. Per case: bytes kept for backward (saved-tensor hooks), peak bytes over forward+backward
(allocator records on CPU, ``max_memory_allocated`` on CUDA) and forward+backward time (median of
``--repeats`` runs after warm-up, providers interleaved run by run, ratios to stock taken pair by pair).

    python benchmarks/cnn_cases.py --models resnet18 resnet50 vgg11 --batch-size 8 --image-size 128

writes a table to docs/benchmarks.md (between markers, so other benchmarks' sections stay) and a plot
to docs/img/cnn_cases.png.
"""

from __future__ import annotations

import argparse
import copy
import pathlib
import platform
import statistics
import sys
import time

import torch
from _docs import write_section

import slimgrad
from slimgrad.cases import CASES, apply_case
from slimgrad.measure import SavedTensors, peak_bytes
from slimgrad.models import build_model

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs"
MEMSAVE_RESNET101 = {"all": 1.09, "input": 0.67, "input-bn-eval": 0.18, "norm": 0.67, "surgical": 0.88}
PROVIDERS = ("eager", "compile", "slimgrad", "slimgrad+compile")


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_providers(model: torch.nn.Module, wanted):
    slim = slimgrad.convert(model)
    built = {"eager": model, "slimgrad": slim}
    if "compile" in wanted:
        built["compile"] = torch.compile(copy.deepcopy(model))
    if "slimgrad+compile" in wanted:
        built["slimgrad+compile"] = torch.compile(slimgrad.convert(model))
    return {k: built[k] for k in wanted}


def step(model, x, input_grad):
    xi = x.detach().requires_grad_(input_grad)
    model(xi).float().sum().backward()


def kept(model, x, input_grad):
    xi = x.detach().requires_grad_(input_grad)
    with SavedTensors(exclude=[model]) as counter:
        out = model(xi)
    out.float().sum().backward()
    return counter.bytes


def run_case(name, case, args, device):
    # Each case builds new models: without a reset dynamo exceeds its recompile limit after a few cases
    # and silently runs the compiled providers eagerly.
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build_model(name, num_classes=10, width_scale=args.width_scale).to(device)
    input_grad = apply_case(model, case)
    providers = make_providers(model, args.providers)
    x = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device)
    for m in providers.values():  # warm-up: compilation, and slimgrad's consumer bookkeeping
        for _ in range(2):
            step(m, x, input_grad)
    row = {}
    for p, m in providers.items():
        row[p] = {"kept": kept(m, x, input_grad), "peak": peak_bytes(lambda m=m: step(m, x, input_grad))}
        for q in m.parameters():
            q.grad = None
    times = {p: [] for p in providers}
    for _ in range(args.repeats):
        for p, m in providers.items():
            _sync(device)
            t0 = time.perf_counter()
            step(m, x, input_grad)
            _sync(device)
            times[p].append(time.perf_counter() - t0)
    for p in providers:
        row[p]["time"] = statistics.median(times[p])
        row[p]["time_ratio"] = statistics.median(t / s for t, s in zip(times[p], times["eager"]))
    return row


def mib(n):
    return f"{n / 2**20:.1f}"


def render(results, args, device) -> str:
    machine = f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    if device.type == "cuda":
        machine = torch.cuda.get_device_name(device)
    lines = [
        f"Command: `python {' '.join(sys.argv)}`  ",
        f"torch {torch.__version__}, device {device.type} ({machine}), input {args.batch_size}×3×"
        f"{args.image_size}², width ×{args.width_scale}, median of {args.repeats} interleaved steps.",
        "",
        "MiB kept for backward / peak MiB over the step / step time ratio to eager (pair by pair). "
        "memsave column: memsave_torch's published peak ratio on ResNet-101 (a different model).",
        "",
        "| model | case | " + " | ".join(f"{p} kept" for p in args.providers) + " | "
        + " | ".join(f"{p} peak" for p in args.providers) + " | "
        + " | ".join(f"{p} time" for p in args.providers if p != "eager") + " | slimgrad/eager kept | memsave |",
        "|" + "---|" * (2 + 3 * len(args.providers) - 1 + 2),
    ]
    for (name, case), row in results.items():
        cells = [mib(row[p]["kept"]) for p in args.providers] + [mib(row[p]["peak"]) for p in args.providers]
        cells += [f"{row[p]['time_ratio']:.2f}" for p in args.providers if p != "eager"]
        ratio = row["slimgrad"]["kept"] / row["eager"]["kept"] if row["eager"]["kept"] else float("nan")
        lines.append(f"| {name} | {case} | " + " | ".join(cells) + f" | {ratio:.3f} | {MEMSAVE_RESNET101[case]} |")
    return "\n".join(lines)


def write_docs(text: str, results, args) -> None:
    DOCS.mkdir(exist_ok=True)
    (DOCS / "img").mkdir(exist_ok=True)
    write_section("cnn_cases", f"## CNN cases (MemSave evaluation)\n\n{text}\n\n![kept bytes](img/cnn_cases.png)")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    labels = [f"{n}\n{c}" for n, c in results]
    fig, ax = plt.subplots(figsize=(max(8, len(labels) * 0.9), 4))
    width = 0.8 / len(args.providers)
    for i, p in enumerate(args.providers):
        ax.bar([j + i * width for j in range(len(labels))], [r[p]["kept"] / 2**20 for r in results.values()],
               width, label=p)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(labels))], labels, fontsize=7)
    ax.set_ylabel("MiB kept for backward")
    ax.legend()
    fig.tight_layout()
    fig.savefig(DOCS / "img" / "cnn_cases.png", dpi=100)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["resnet18", "resnet50", "vgg11", "convnext", "vit"])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    parser.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=PROVIDERS)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--image-size", type=int, default=128)
    parser.add_argument("--width-scale", type=float, default=1.0, help="channel width multiplier for every model")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-docs", action="store_true")
    args = parser.parse_args()
    if "eager" not in args.providers or "slimgrad" not in args.providers:
        parser.error("--providers must include eager and slimgrad (ratios are taken against eager)")
    device = torch.device(args.device)
    results = {}
    for name in args.models:
        for case in args.cases:
            print(f"running {name} / {case} ...", file=sys.stderr, flush=True)
            results[(name, case)] = run_case(name, case, args, device)
    text = render(results, args, device)
    print(text)
    if not args.no_docs:
        write_docs(text, results, args)


if __name__ == "__main__":
    main()

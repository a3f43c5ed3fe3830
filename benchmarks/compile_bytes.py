"""Bytes kept for backward under torch.compile (inductor) vs eager, stock and slimgrad, on the in-repo CNNs
and a LoRA step; step times for the LoRA step. Saved tensors are counted with ``SavedTensors`` around the
compiled call (AOTAutograd's compiled function saves through ``save_for_backward``), parameters excluded.

    python benchmarks/compile_bytes.py --model resnet18 --cases input-bn-eval,input,all,norm,surgical
    python benchmarks/compile_bytes.py --lora
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import sys
import time

import torch
from _docs import write_section  # benchmarks/ is on sys.path when run as a script

import slimgrad
from slimgrad.cases import apply_case
from slimgrad.measure import SavedTensors
from slimgrad.models.cnn import build_model

PROVIDERS = (("stock eager", False, False), ("slimgrad eager", True, False), ("stock compiled", False, True),
             ("slimgrad compiled", True, True))


def _kept(model, step, compiled):
    torch._dynamo.reset()
    run = torch.compile(model, fullgraph=not isinstance(step, tuple)) if compiled else model
    call = (lambda: run(**step[0])) if isinstance(step, tuple) else (lambda: run(step.clone().requires_grad_(
        step.requires_grad)))

    def loss(out):
        return out.loss if hasattr(out, "loss") else out.sum()

    loss(call()).backward()  # warm-up (and compile)
    with SavedTensors(exclude=[model]) as counter:
        out = call()
    loss(out).backward()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        loss(call()).backward()
        times.append(time.perf_counter() - t0)
    return counter.bytes / 2**20, statistics.median(times) * 1e3


def cnn(args):
    torch.manual_seed(0)
    base = build_model(args.model, width_scale=args.width_scale, num_classes=10)
    x = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
    for case in args.cases.split(","):
        model = copy.deepcopy(base)
        x.requires_grad_(apply_case(model, case))
        row = {}
        for name, slim, compiled in PROVIDERS:
            m = copy.deepcopy(model)
            row[name] = _kept(slimgrad.convert(m) if slim else m, x, compiled)
        _emit(f"| {args.model} | {case} | " + " | ".join(f"{b:.3f}" for b, _ in row.values()) + " |")


def lora_model(dropout):
    """The LoRA step's model and token batch: Llama-like, hidden 128, 2 layers, bf16, fp32 rank-8 adapters on
    all seven projections, 2x64 tokens (shared with compile_speed.py)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4,
                      vocab_size=1024)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(LlamaForCausalLM(cfg).to(torch.bfloat16),
                           LoraConfig(r=8, lora_alpha=16, target_modules=targets, lora_dropout=dropout))
    return model, torch.randint(0, 1024, (2, 64))


def lora(args):
    model, ids = lora_model(args.lora_dropout)
    row = {}
    for name, slim, compiled in PROVIDERS:
        m = copy.deepcopy(model).train()
        row[name] = _kept(slimgrad.convert(m) if slim else m, ({"input_ids": ids, "labels": ids},), compiled)
    _emit("| Llama + LoRA | step | " + " | ".join(f"{b:.3f} MiB, {t:.0f} ms" for b, t in row.values()) + " |")


def add_arguments(parser):
    """The CNN and LoRA-step options, shared with compile_speed.py."""
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--cases", default="input-bn-eval,input,all,norm,surgical")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--width-scale", type=float, default=0.125)
    parser.add_argument("--lora", action="store_true", help="the LoRA step instead of a CNN")
    parser.add_argument("--lora-dropout", type=float, default=0.0)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)
    _emit(f"torch {torch.__version__}, cpu ({platform.processor() or platform.machine()}), MiB kept by one step")
    _emit("| model | case | " + " | ".join(name for name, *_ in PROVIDERS) + " |")
    _emit("|---|---|" + "---:|" * len(PROVIDERS))
    lora(args) if args.lora else cnn(args)
    key = f"lora_dropout{args.lora_dropout:g}" if args.lora else args.model
    command = f"python benchmarks/compile_bytes.py {' '.join(sys.argv[1:])}".strip()
    write_section(f"compile_bytes_{key}", f"## Bytes kept under torch.compile: {key}\n\n`{command}`\n\n"
                  f"{_LINES[0]}\n\n" + "\n".join(_LINES[1:]))


_LINES = []


def _emit(line: str) -> None:
    print(line, flush=True)
    _LINES.append(line)


if __name__ == "__main__":
    main()

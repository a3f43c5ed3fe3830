"""LoRA training step on a Llama-like model (or SmolLM2-135M): bytes kept, peak bytes, step time.

Providers on the same weights and batch: stock eager peft, ``torch.compile`` of it, ``slimgrad.convert``,
and ``slimgrad.convert(chunked_loss=True)``. Bytes kept are counted with saved-tensor hooks (parameters
excluded), peak bytes over forward+backward with allocator records (CPU) or ``max_memory_allocated``
(CUDA), time is the median of interleaved steps with ratios to eager taken pair by pair.

    python benchmarks/llm_lora.py                       # the issue's Llama-like config, bf16, 4×512 tokens
    python benchmarks/llm_lora.py --model smollm2 --batch-size 2 --seq-len 256
    python benchmarks/llm_lora.py --model mixtral-like  # 8 experts, top-2, LoRA on q/k/v/o (experts frozen)
    python benchmarks/llm_lora.py --model gpt-oss-like  # GPT-OSS's clamped SwiGLU experts, LoRA on q/k/v/o
    python benchmarks/llm_lora.py --model falcon-like   # Falcon-7B's layout (bias-less FalconLinear), LoRA on all
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
from slimgrad.measure import SavedTensors, peak_bytes

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MODELS = ["llama-like", "smollm2", "mixtral-like", "gpt-oss-like", "falcon-like"]
FALCON_PROJECTIONS = ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"]


def targets_of(model: str) -> list[str]:
    """LoRA's targets: a MoE layer's experts are 3-D parameters, not the Linear layers LoRA targets, so the
    MoE models get LoRA on the attention."""
    if model == "falcon-like":
        return FALCON_PROJECTIONS
    return PROJECTIONS[:4] if model in ("mixtral-like", "gpt-oss-like") else PROJECTIONS


def build(args):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if args.model == "smollm2":
        sys.path.insert(0, str(ROOT / "examples"))
        from real_weights_lora import smollm2_dir
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(smollm2_dir())
    elif args.model == "mixtral-like":
        from transformers import MixtralConfig, MixtralForCausalLM

        cfg = MixtralConfig(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
                            num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, vocab_size=8192)
        model = MixtralForCausalLM(cfg)  # experts_implementation: transformers' default, grouped_mm
    elif args.model == "gpt-oss-like":
        from transformers import GptOssConfig, GptOssForCausalLM

        cfg = GptOssConfig(hidden_size=512, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                           num_key_value_heads=8, head_dim=64, num_local_experts=8, num_experts_per_tok=4,
                           vocab_size=8192, sliding_window=128, layer_types=["sliding_attention", "full_attention"] * 2)
        model = GptOssForCausalLM(cfg)
    elif args.model == "falcon-like":
        from transformers import FalconConfig, FalconForCausalLM

        cfg = FalconConfig(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, vocab_size=8192,
                           multi_query=True, parallel_attn=True, bias=False)  # Falcon-7B's layout
        model = FalconForCausalLM(cfg)
    else:
        cfg = LlamaConfig(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
                          vocab_size=8192)
        model = LlamaForCausalLM(cfg)
    model = model.to(getattr(torch, args.dtype)).to(args.device)
    model = get_peft_model(model, LoraConfig(r=args.rank, lora_alpha=2 * args.rank,
                                             target_modules=targets_of(args.model)))
    model.train()
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (args.batch_size, args.seq_len), device=args.device)
    return model, {"input_ids": ids, "labels": ids}


def providers(model, wanted):
    made = {}
    for name in wanted:
        if name == "eager":
            made[name] = model
        elif name == "compile":
            made[name] = torch.compile(copy.deepcopy(model))
        elif name == "slimgrad":
            made[name] = slimgrad.convert(model)
        elif name == "slimgrad+chunked":
            made[name] = slimgrad.convert(model, chunked_loss=True)
    return made


def step(model, batch):
    model(**batch).loss.backward()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=MODELS, default="llama-like")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--providers", nargs="+", default=["eager", "compile", "slimgrad", "slimgrad+chunked"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-docs", action="store_true")
    args = parser.parse_args()

    model, batch = build(args)
    made = providers(model, args.providers)
    for m in made.values():
        for _ in range(2):
            step(m, batch)
    rows = {}
    for name, m in made.items():
        with SavedTensors(exclude=[m]) as counter:
            out = m(**batch)
        out.loss.backward()
        rows[name] = {"kept": counter.bytes, "peak": peak_bytes(lambda m=m: step(m, batch)), "times": []}
    for _ in range(args.repeats):
        for name, m in made.items():
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            step(m, batch)
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            rows[name]["times"].append(time.perf_counter() - t0)
    eager = rows["eager"]
    lines = [
        f"Command: `python {' '.join(sys.argv)}`  ",
        f"torch {torch.__version__}, {args.device} ({platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} threads), {args.model}, {args.dtype}, batch {args.batch_size}×{args.seq_len}, "
        f"LoRA r={args.rank} on {', '.join(targets_of(args.model))}, "
        f"median of {args.repeats} interleaved steps.",
        "",
        "| provider | MiB kept for backward | ratio to eager | peak MiB over the step | step time (s) | time ratio |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, r in rows.items():
        ratio = statistics.median(t / e for t, e in zip(r["times"], eager["times"]))
        lines.append(f"| {name} | {r['kept'] / 2**20:.1f} | {r['kept'] / eager['kept']:.3f} | "
                     f"{r['peak'] / 2**20:.1f} | {statistics.median(r['times']):.3f} | {ratio:.2f} |")
    text = "\n".join(lines)
    print(text)
    if not args.no_docs:
        write_section(f"llm_lora:{args.model}:{args.dtype}",
                      f"## LoRA training step: {args.model}, {args.dtype}\n\n{text}")


if __name__ == "__main__":
    main()

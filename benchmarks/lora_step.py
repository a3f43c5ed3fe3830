"""LoRA fine-tuning step of a small Llama (built from a config, random weights): stock peft vs slimgrad.

Adapters of rank ``--rank`` on all seven projections (q, k, v, o, gate, up, down), base weights frozen, the
model in ``--dtype`` (peft upcasts the adapters to fp32 by default). Reports bytes kept for backward by one
adapted layer (q_proj) and by the whole model (saved-tensor hooks, storages counted once, parameters left
out), peak bytes over forward+backward (allocator records on CPU) and step time (median of ``--repeats``
runs, stock and slimgrad interleaved run by run). slimgrad converts only the LoRA layers (``lora``) or
every family it knows (``all``).

    OMP_NUM_THREADS=2 python benchmarks/lora_step.py --dtype bfloat16 --rank 8 --dropout 0.0 0.1
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import time

import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.lora.layer import Linear as LoraLinear
from transformers import LlamaConfig, LlamaForCausalLM

import slimgrad
from slimgrad.measure import SavedTensors, peak_bytes

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build(args, dropout):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                      num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=args.seq)
    model = LlamaForCausalLM(cfg).to(getattr(torch, args.dtype))
    return get_peft_model(model, LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=TARGETS,
                                            lora_dropout=dropout, init_lora_weights=False))


def loss_of(model, ids):
    return model(input_ids=ids).logits.float().square().mean()


def kept(model, ids):
    with SavedTensors(exclude=[model]) as counter:
        loss = loss_of(model, ids)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return counter.bytes


def layer_kept(model, args):
    """Bytes kept by the first q_proj alone for an input that needs grad, like every layer's but the first."""
    layer = next(m for n, m in model.named_modules() if n.endswith("layers.0.self_attn.q_proj"))
    x = torch.randn(args.batch, args.seq, args.hidden).to(getattr(torch, args.dtype)).requires_grad_()
    with SavedTensors(exclude=[layer]) as counter:
        out = layer(x)
    out.float().sum().backward()
    return counter.bytes


def timed(model, ids):
    start = time.perf_counter()
    loss_of(model, ids).backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def mib(n):
    return f"{n / 2**20:.2f}"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--dropout", type=float, nargs="+", default=[0.0, 0.1])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))

    print(f"torch {torch.__version__}, {platform.machine()}, {torch.get_num_threads()} threads; Llama hidden "
          f"{args.hidden}, {args.layers} layers, batch {args.batch}x{args.seq}, {args.dtype}, rank {args.rank}")
    print("| dropout | provider | q_proj kept MiB | model kept MiB | peak MiB | step ms | time ratio |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for p in args.dropout:
        stock = build(args, p)
        providers = {"peft": stock,
                     "slimgrad (lora)": slimgrad.convert(stock, include=[LoraLinear]),
                     "slimgrad (all)": slimgrad.convert(copy.deepcopy(stock))}
        for m in providers.values():
            for _ in range(2):
                timed(m, ids)
        times = {k: [] for k in providers}
        for _ in range(args.repeats):
            for k, m in providers.items():
                times[k].append(timed(m, ids))
        for k, m in providers.items():
            kept_b = kept(m, ids)
            peak = peak_bytes(lambda m=m: loss_of(m, ids).backward())
            m.zero_grad(set_to_none=True)
            ratio = statistics.median(t / s for t, s in zip(times[k], times["peft"]))
            print(f"| {p} | {k} | {mib(layer_kept(m, args))} | {mib(kept_b)} | {mib(peak)} | "
                  f"{1e3 * statistics.median(times[k]):.1f} | {ratio:.3f} |")


if __name__ == "__main__":
    main()

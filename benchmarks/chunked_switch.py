"""Where chunked_loss=True switches between stock's logits and the chunked path when the output embedding trains.

A one-layer Llama (vocab 8192) fully fine-tuned, stock against ``convert(chunked_loss=True)``, the output freed
before backward as the Hugging Face Trainer does: the step's peak (allocator records on CPU) at each token count,
hidden 64 and 256, fp32 weights, bf16 weights, and fp32 weights under bf16 autocast. The switch
(``hf_loss._logits_cost_less``) must keep every row at or under stock's peak; docs/chunked_loss.md ("Per call")
quotes this table.

    OMP_NUM_THREADS=1 python benchmarks/chunked_switch.py
"""

from __future__ import annotations

import argparse
import copy
import platform

import torch

import slimgrad
from slimgrad.measure import peak_bytes


def build(hidden: int, dtype: torch.dtype):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=8192)
    return transformers.LlamaForCausalLM(cfg).to(dtype).train()


def step_peak(model, ids, autocast: bool) -> tuple[int, bool]:
    chunked = []

    def step():
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            out = model(input_ids=ids, labels=ids)
        chunked.append(out.logits is None)
        loss = out.loss
        del out  # freed before backward, as the Trainer does
        loss.backward()

    step()
    for p in model.parameters():
        p.grad = None
    return peak_bytes(step), chunked[-1]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=list(range(130, 420, 10)) + [64, 139, 171, 205, 1024])
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {platform.machine()}, {torch.get_num_threads()} thread(s)")
    print("| hidden | weights | tokens | path | stock peak MiB | converted peak MiB | ratio |")
    print("|---:|---|---:|---|---:|---:|---:|")
    worst = 0.0
    for hidden in (64, 256):
        for mode in ("fp32", "bf16", "fp32 + autocast"):
            stock = build(hidden, torch.bfloat16 if mode == "bf16" else torch.float32)
            slim = slimgrad.convert(copy.deepcopy(stock), chunked_loss=True)
            for tokens in sorted(set(args.tokens)):
                ids = torch.randint(0, 8192, (1, tokens), generator=torch.Generator().manual_seed(1))
                s, _ = step_peak(stock, ids, mode.endswith("autocast"))
                c, chunked = step_peak(slim, ids, mode.endswith("autocast"))
                worst = max(worst, c / s)
                print(f"| {hidden} | {mode} | {tokens} | {'chunked' if chunked else 'stock'} | {s / 2**20:.2f} | "
                      f"{c / 2**20:.2f} | {c / s:.3f} |", flush=True)
    print(f"worst ratio {worst:.3f}")


if __name__ == "__main__":
    main()

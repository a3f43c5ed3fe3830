"""What `convert(chunked_loss=True)` costs in time where the head is a large share of the step, and how the rows per
chunk set it: GPT-2 (hidden 256, 4 layers, vocab 50257) with LoRA on ``c_attn`` (dropout 0.1), batch 4x128, stock
against the chunked loss; then the head alone (508 tokens) at several chunk sizes, frozen (LoRA's case: the hidden
states' gradient is formed in the forward, from the log-probabilities at hand) and trained (the backward computes each
chunk's logits again). Each chunk reads the whole head weight, so chunks of few rows are slow (docs/chunked_loss.md,
Time). Interleaved steps, one thread.

    python benchmarks/chunked_loss_time.py [--steps 10]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
import warnings

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tqdm import tqdm  # noqa: E402

import slimgrad  # noqa: E402
from slimgrad.functional.cross_entropy import default_chunk_size, fused_linear_cross_entropy  # noqa: E402

VOCAB, HIDDEN = 50257, 256


def _interleaved(fns: dict, steps: int, what: str) -> dict:
    """Median seconds of each callable, run in turn (the order rotating) after two warm-up calls each."""
    for f in fns.values():
        f()
        f()
    times = {k: [] for k in fns}
    names = list(fns)
    for i in tqdm(range(steps), desc=what, leave=False):
        for k in names[i % len(names):] + names[:i % len(names)]:
            t0 = time.perf_counter()
            fns[k]()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def whole_step(steps: int) -> dict:
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=HIDDEN, n_layer=4, n_head=4, vocab_size=VOCAB, n_positions=256))
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.1, target_modules=["c_attn"],
                                             fan_in_fan_out=True)).train()
    chunked = slimgrad.convert(copy.deepcopy(model), chunked_loss=True)
    ids = torch.randint(0, VOCAB, (4, 128), generator=torch.Generator().manual_seed(1))

    def step(m):
        def run():
            out = m(input_ids=ids, labels=ids)
            out.loss.backward()
            m.zero_grad(set_to_none=True)
            return out
        return run

    assert step(chunked)().logits is None, "the chunked loss did not engage"
    return _interleaved({"stock": step(model), "convert(chunked_loss=True)": step(chunked)}, steps, "whole step")


def head_alone(steps: int) -> dict:
    torch.manual_seed(0)
    tokens = 508
    weight = torch.randn(VOCAB, HIDDEN) * 0.02
    h0 = torch.randn(tokens, HIDDEN)
    target = torch.randint(0, VOCAB, (tokens,))

    def stock():
        h = h0.clone().requires_grad_()
        F.cross_entropy(F.linear(h, weight).float(), target).backward()

    def chunked(rows):
        def run():
            h = h0.clone().requires_grad_()
            fused_linear_cross_entropy(h, weight, target, chunk_size=rows).backward()
        return run

    w_trained = weight.clone().requires_grad_()

    def stock_trained():
        h = h0.clone().requires_grad_()
        F.cross_entropy(F.linear(h, w_trained).float(), target).backward()
        w_trained.grad = None

    def chunked_trained():
        h = h0.clone().requires_grad_()
        fused_linear_cross_entropy(h, w_trained, target).backward()
        w_trained.grad = None

    fns = {"stock": stock}
    fns.update({f"chunks of {r} rows": chunked(r) for r in (21, 64, 128, 254, tokens)})
    default = default_chunk_size(tokens, HIDDEN, VOCAB)
    fns[f"default ({default} rows)"] = chunked(None)
    fns["stock, head trains"] = stock_trained
    fns[f"default ({default} rows), head trains (recomputes)"] = chunked_trained
    return _interleaved(fns, steps, "head alone")


def main() -> None:
    warnings.filterwarnings("ignore")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, one thread; GPT-2 hidden {HIDDEN}, vocab {VOCAB}")
    for title, result in (("whole LoRA step, batch 4x128", whole_step(args.steps)),
                          ("head alone, 508 tokens", head_alone(args.steps))):
        base = result["stock"]
        print(f"\n{title}\n| | ms | ratio to stock |\n|---|---:|---:|")
        for name, t in result.items():
            print(f"| {name} | {t * 1e3:.1f} | {t / base:.2f} |")


if __name__ == "__main__":
    main()

"""How much fits: the longest sequence a LoRA step takes within a memory budget, found before any run.

    OMP_NUM_THREADS=1 python benchmarks/how_much_fits.py [--budgets 0.5GiB,1GiB] [--batch-size 4] [--write]

The Llama-like model of benchmarks/llm_lora.py (hidden 512, 4 layers, vocab 8192, bf16, rank-8 LoRA on all
seven projections, AdamW). For each budget and provider — stock eager peft, ``slimgrad.convert``,
``convert(chunked_loss=True)``, and that plus a plan (``slimgrad.plan``: checkpointing only the layers that
must) — the longest sequence whose whole step (weights, optimizer state, activations, gradients, temporaries)
fits, found by :func:`slimgrad.largest_fitting` (simulated steps on fake tensors, nothing allocated). Each
answer is then checked by a real step at that length: the measured peak (the allocator's records, plus what
exists before the step) must be within the budget. ``--write`` puts the table into docs/estimate.md.
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

import slimgrad
from slimgrad.estimate import _gib, parse_bytes
from slimgrad.plan import apply_plan

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "estimate.md"
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
                      vocab_size=8192, max_position_embeddings=8192)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=PROJECTIONS))
    model.train()
    return model


def static_bytes(model, opt, batch) -> int:
    """What exists before a step: parameters, buffers, optimizer state, the batch."""
    seen, total = set(), 0
    tensors = [*model.parameters(), *model.buffers(), *batch.values()]
    for state in opt.state.values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    for t in tensors:
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def measured_peak(model, batch) -> int:
    """Peak bytes of a real steady-state AdamW step (everything alive included)."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

    def step():
        opt.zero_grad(set_to_none=True)
        model(**batch).loss.backward()
        opt.step()

    step()
    opt.zero_grad(set_to_none=True)
    return static_bytes(model, opt, batch) + slimgrad.peak_bytes(step)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", default="0.25GiB,0.5GiB")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-seq", type=int, default=8192)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    budgets = [b.strip() for b in args.budgets.split(",") if b.strip()]
    stock = build()
    slim = slimgrad.convert(stock)
    chunked = slimgrad.convert(stock, chunked_loss=True)
    ids = torch.randint(0, 8192, (args.batch_size, args.max_seq))

    def example(n):
        return {"input_ids": ids[:, :n], "labels": ids[:, :n]}

    def planned_fit(model, budget, start):
        """The longest sequence a plan fits: doubling from ``start`` (what fits without a plan), then bisection
        on plan(...).fits."""
        def fits(n):
            return slimgrad.plan(model, budget, example(n), optimizer="adamw").fits
        lo, hi = start, max(16, 2 * start)
        while hi <= args.max_seq and fits(hi):
            lo, hi = hi, hi * 2
        hi = min(hi, args.max_seq + 1)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo

    rows = []
    started = time.perf_counter()
    providers = [("stock eager peft", stock), ("slimgrad.convert", slim),
                 ("convert(chunked_loss=True)", chunked), ("chunked_loss + plan", chunked)]
    total = len(budgets) * len(providers)
    for i, budget in enumerate(budgets):
        limit = parse_bytes(budget)
        for j, (name, model) in enumerate(providers):
            n_done = i * len(providers) + j
            print(f"\r[{'#' * (30 * n_done // total)}{'.' * (30 - 30 * n_done // total)}] {budget} {name} "
                  f"({time.perf_counter() - started:.0f} s)" + " " * 20, end="", file=sys.stderr, flush=True)
            t = time.perf_counter()
            if name.endswith("plan"):
                n = planned_fit(model, budget, rows[-1][3] or 0)
                chosen = slimgrad.plan(model, budget, example(n), optimizer="adamw") if n else None
                est = chosen.peak_after if chosen else None
                acts = chosen.actions if chosen else {}
            else:
                n, e = slimgrad.largest_fitting(model, budget, example, low=16, high=args.max_seq, optimizer="adamw")
                est, acts = (e.peak_bytes if e else None), {}
            seconds = time.perf_counter() - t
            measured = None
            if n:
                apply_plan(model, acts)
                try:
                    measured = measured_peak(model, example(n))
                finally:
                    apply_plan(model, {})
            rows.append((budget, limit, name, n, est, measured, seconds, len(acts)))
    print(f"\r[{'#' * 30}] done in {time.perf_counter() - started:.0f} s" + " " * 60, file=sys.stderr)

    cmd = "python benchmarks/how_much_fits.py " + " ".join(sys.argv[1:])
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    lines = [
        "## How much fits: the longest sequence in a budget",
        "",
        f"`OMP_NUM_THREADS=1 {cmd.strip()}` — torch {torch.__version__}, {machine}, {time.strftime('%Y-%m-%d')}. "
        f"Llama-like (hidden 512, 4 layers, vocab 8192), bf16, rank-8 LoRA on all seven projections, AdamW, "
        f"batch {args.batch_size}. The length is found by simulation alone (`slimgrad.largest_fitting`, or "
        f"bisection on `slimgrad.plan(...).fits`); the measured peak is one real step at that length (allocator "
        f"records plus weights, optimizer state and batch).",
        "",
        "| budget | provider | longest sequence | estimated peak | measured peak | within budget | blocks "
        "checkpointed | search s |",
        "|---|---|---:|---:|---:|---|---:|---:|",
    ]
    for budget, limit, name, n, est, measured, seconds, n_acts in rows:
        ok = "–" if measured is None else ("yes" if measured <= limit else f"NO (+{_gib(measured - limit)})")
        lines.append(f"| {budget} | {name} | {n or 'none'} | {_gib(est) if est else '–'} | "
                     f"{_gib(measured) if measured else '–'} | {ok} | {n_acts} | {seconds:.0f} |")
    text = "\n".join(lines)
    print(text)
    if args.write:
        write_section("how-much-fits", text, DOC)


if __name__ == "__main__":
    main()

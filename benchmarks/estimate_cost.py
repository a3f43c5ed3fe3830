"""What an estimate and a plan cost before the run: wall time by model depth.

    OMP_NUM_THREADS=1 python benchmarks/estimate_cost.py [--layers 2,8,32] [--write]

A Llama built from a config (hidden 256, intermediate 688, 8 heads, 4 KV heads), peft LoRA of rank 8 with
dropout 0.1 on q_proj and v_proj, converted; batch 2 x 256 tokens, AdamW. Timed: ``slimgrad.estimate`` (one
step simulated on fake tensors) and ``slimgrad.plan`` at 70 % of the estimated peak (the estimates its search
runs, plus a short measured forward per block). The estimate's cost grows with the number of ops in a step,
not with tensor sizes: it allocates almost nothing. ``--write`` puts the table into docs/estimate.md with the
command, torch version and machine.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import platform
import sys
import time

import torch
from _docs import write_section

import slimgrad

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "estimate.md"
MiB = 2**20


def model_of(layers: int):
    import peft
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=688,
                                   num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4)
    model = transformers.LlamaForCausalLM(cfg)
    model = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.1))
    return slimgrad.convert(model)


def measure(layers: int) -> dict:
    model = model_of(layers)
    ids = torch.randint(0, 1000, (2, 256), generator=torch.Generator().manual_seed(1))
    example = {"input_ids": ids, "labels": ids}
    t = time.perf_counter()
    est = slimgrad.estimate(model, optimizer="adamw", **example)
    estimate_s = time.perf_counter() - t
    t = time.perf_counter()
    plan = slimgrad.plan(model, int(est.peak_bytes * 0.7), example, optimizer="adamw")
    plan_s = time.perf_counter() - t
    return {"layers": layers, "peak": est.peak_bytes, "estimate_s": estimate_s, "plan_s": plan_s,
            "fits": plan.fits, "blocks": len(plan.actions)}


def _old_sweep(self) -> None:
    """The estimate's sweep before ac5e7d5: every live storage asked whether it died, at every op."""
    dead = [k for k, v in self.live.items() if v[0].expired()]
    for k in dead:
        _, n, kind, _ = self.live.pop(k)
        self.watches.pop(k, None)
        self.current -= n
        self.totals[kind] -= n
    self.dead.clear()


@contextlib.contextmanager
def old_sweep():
    allocations = sys.modules["slimgrad.estimate"]._Allocations
    new = allocations.sweep
    allocations.sweep = _old_sweep
    try:
        yield
    finally:
        allocations.sweep = new


def measure_7b_on_meta() -> dict:
    """A Llama-7B config (transformers' LlamaConfig defaults: hidden 4096, 32 layers) built on the meta device in
    bf16, rank-16 LoRA on q/v, 1 x 512 tokens, AdamW, estimated as if on CPU: nothing of it is allocated."""
    import peft
    import transformers

    cfg = transformers.LlamaConfig()
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    model = slimgrad.convert(peft.get_peft_model(model, peft.LoraConfig(r=16, target_modules=["q_proj", "v_proj"])))
    ids = torch.randint(0, cfg.vocab_size, (1, 512), generator=torch.Generator().manual_seed(1))

    def timed():
        t = time.perf_counter()
        est = slimgrad.estimate(model, input_ids=ids, labels=ids, optimizer="adamw", device="cpu")
        return est, time.perf_counter() - t

    est, first = timed()  # the first in the process measures each op signature's scratch on real tensors
    _, again = timed()
    return {"peak": est.peak_bytes, "first_s": first, "again_s": again, "timed": timed}


def table(rows: list[dict]) -> str:
    old = "old" in rows[0]
    lines = ["| layers | estimated peak | estimate | plan at 70 % | plan fits | blocks planned |"
             + (" estimate, old sweep | plan, old sweep |" if old else ""),
             "|---:|---:|---:|---:|---|---:|" + ("---:|---:|" if old else "")]
    for r in rows:
        line = (f"| {r['layers']} | {r['peak'] / MiB:.1f} MiB | {r['estimate_s']:.1f} s | {r['plan_s']:.1f} s | "
                f"{'yes' if r['fits'] else 'no'} | {r['blocks']} |")
        if old:
            line += f" {r['old']['estimate_s']:.1f} s | {r['old']['plan_s']:.1f} s |"
        lines.append(line)
    return "\n".join(lines)


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="2,8,32", help="comma-separated decoder depths")
    parser.add_argument("--write", action="store_true", help="write the table into docs/estimate.md")
    parser.add_argument("--no-7b", action="store_true", help="skip the Llama-7B config on the meta device")
    parser.add_argument("--old-sweep", action="store_true",
                        help="also time each with the estimate's sweep before ac5e7d5 (quadratic; minutes)")
    args = parser.parse_args(argv)
    try:
        depths = [int(n) for n in args.layers.split(",") if n]
    except ValueError:
        parser.error(f"--layers takes comma-separated integers, got {args.layers!r}")
    if not depths or min(depths) < 1:
        parser.error(f"--layers needs depths of at least 1, got {args.layers!r}")
    import logging

    logging.getLogger("slimgrad").setLevel(logging.ERROR)  # the plan is logged; the table says what it chose
    rows = []
    started = time.perf_counter()
    measure(min(depths))  # the process's first estimate pays one-time costs: no row (nor sweep) should carry them
    for i, n in enumerate(depths):
        print(f"\r[{time.perf_counter() - started:5.0f} s] {i}/{len(depths)}: {n} layers" + " " * 20, end="",
              file=sys.stderr, flush=True)
        rows.append(measure(n))
        if args.old_sweep:
            with old_sweep():
                rows[-1]["old"] = measure(n)
    big = None
    if not args.no_7b:
        print(f"\r[{time.perf_counter() - started:5.0f} s] Llama-7B on meta" + " " * 20, end="", file=sys.stderr,
              flush=True)
        big = measure_7b_on_meta()
        if args.old_sweep:
            with old_sweep():
                big["old_s"] = big["timed"]()[1]
    print(file=sys.stderr)
    command = ("OMP_NUM_THREADS=1 python benchmarks/estimate_cost.py"
               + (f" --layers {args.layers}" if args.layers != "2,8,32" else "")
               + (" --no-7b" if args.no_7b else "") + (" --old-sweep" if args.old_sweep else ""))
    body = "\n".join([
        "## What an estimate and a plan cost",
        "",
        f"`{command} --write` (torch {torch.__version__}, {platform.machine()}, {os.cpu_count()} cores, "
        f"{torch.get_num_threads()} thread(s)): a Llama LoRA built from a config (hidden 256, LoRA r=8 with dropout on "
        "q/v), converted, batch 2×256, AdamW; wall time of `slimgrad.estimate` and of `slimgrad.plan` at 70 % of "
        "the estimated peak. The estimate costs in proportion to the step's op count (it simulates on fake tensors), "
        "not its tensor sizes (each row after a warm-up estimate); a plan runs one "
        "estimate per candidate its bisection tries (15 at 32 layers) and a short measured forward per block. "
        "At 2 layers 70 % does not fit: that peak is the loss's transient, which no block's plan lowers.",
        "",
        table(rows),
    ] + ([] if not args.old_sweep else [
        "",
        "The old-sweep columns time the same calls with the estimate's sweep before ac5e7d5, which asked every live "
        "storage whether it had died at every op and so grew as ops × live storages.",
    ]) + ([] if big is None else [
        "",
        f"A Llama-7B config (transformers' `LlamaConfig()` defaults) built on the meta device in bf16, rank-16 LoRA "
        f"on q/v, 1×512 tokens, AdamW, estimated for the CPU without allocating any of it: "
        f"**{big['peak'] / 2**30:.2f} GiB in {big['first_s']:.1f} s** (the first estimate in the process, which "
        f"also measures each op signature's scratch on real tensors of its shapes); again: {big['again_s']:.1f} s"
        + (f", with the old sweep {big['old_s']:.1f} s." if "old_s" in big else "."),
    ]))
    print(body)
    if args.write:
        write_section("estimate-cost", body, DOC)
    return body


if __name__ == "__main__":
    main()

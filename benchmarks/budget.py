"""Fitting a memory budget: slimgrad's plan against the tools users pick instead (issue 23, item 3).

    OMP_NUM_THREADS=1 python benchmarks/budget.py [--only llama,qlora,cnn] [--repeats 7] [--no-compile]
                                                  [--quick [--compile]] [--device cpu|cuda] [--write [--out PATH]]

One GPU run (the GPU table): ``python benchmarks/budget.py --device cuda --quick --write --out docs/budget_gpu.md``.

For a Llama-like bf16 model with peft LoRA (q/k/v/o, LoRA dropout 0.05, 4 layers), the same model as QLoRA
trains it (bitsandbytes 4-bit nf4 linear layers, bf16 compute, the rest prepared for k-bit training) with the
same LoRA, and the in-repo ResNet-18 (every parameter trains, batch norm in training mode): stock's step peak at
a reference batch (the peak above the step's start, ``slimgrad.peak_bytes`` around one forward + backward: the
profiler's allocator records on CPU, ``max_memory_allocated`` on CUDA) sets three budgets, 25 %, 50 % and 75 %
of it. For each budget and each alternative:

* the largest batch whose MEASURED step peak fits the budget (the sequence length stays fixed for the Llamas):
  a search over real steps (a linear guess from two measured sizes, then doubling / halving and bisection);
* the step time at the reference batch (median of interleaved rounds, one thread), or "does not fit" where
  the alternative's measured peak at the reference batch is over the budget.

The alternatives: stock + full checkpointing (transformers' ``activation_checkpointing_enable`` with
``use_reentrant=False`` on the Llamas; ``apply_plan`` (``from slimgrad.plan import apply_plan``) with every block
"checkpoint" on the stock ResNet), stock + transformers' offloaded checkpointing (``offload=True``, and the same
construct on the ResNet's stages; on CPU there is no device memory to offload from: reported n/a), ``torch.compile``
with ``torch._functorch.config.activation_memory_budget`` = the budget's fraction (``dynamic=True``, one compile per
budget, compile time reported), slimgrad alone (``slimgrad.convert(model)``), slimgrad + every block checkpointed,
and slimgrad's plan (``slimgrad.convert(model, budget=..., example=batch)``, re-planned for every candidate batch
with that batch; on CUDA it may offload blocks too).

``slimgrad.convert(budget=)`` budgets the whole step (weights, buffers and inputs included, what a device
holds); the benchmark's budgets are step peaks, so the plan is given the step budget plus the bytes of the
parameters (a 4-bit weight's quantization state included), buffers and batch that exist before the step.
``--write`` puts the tables into ``--out`` (default docs/budget.md) with the command, versions and machine.
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import pathlib
import platform
import statistics
import sys
import time

import torch

import slimgrad
from slimgrad.estimate import _packed_tensors, blocks_of
from slimgrad.measure import peak_bytes
from slimgrad.plan import apply_plan, planned_actions

MiB = 2**20
FRACTIONS = (0.25, 0.5, 0.75)
DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "budget.md"


# ---------------------------------------------------------------------------------------------- models


class Workload:
    """A model family: ``build()`` the stock model, ``batch(n)`` a batch of size n, ``step(model, batch)`` one
    forward + backward; ``ref``: the reference batch size; ``blocks``: what full checkpointing covers."""

    name = ""
    size_name = "batch"
    ref = 8
    cap = 256

    def build(self, device):
        raise NotImplementedError

    def batch(self, n: int, device):
        raise NotImplementedError


class Llama(Workload):
    def __init__(self, quick: bool):
        self.layers, self.seq = (2, 32) if quick else (4, 128)
        self.ref = 4 if quick else 8
        self.cap = 16 if quick else 128
        self.name = f"Llama-like bf16 + peft LoRA (q/k/v/o, dropout 0.05), {self.layers} layers, seq {self.seq}"
        self.key = "llama"

    def config(self):
        from transformers import LlamaConfig

        return LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=344, num_hidden_layers=self.layers,
                           num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024, use_cache=False)

    @staticmethod
    def lora(model):
        import peft

        lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                               lora_dropout=0.05, init_lora_weights=False)
        return peft.get_peft_model(model, lora).train()

    def build(self, device):
        from transformers import LlamaForCausalLM

        return self.lora(LlamaForCausalLM(self.config()).to(torch.bfloat16)).to(device)

    def batch(self, n, device):
        ids = torch.randint(0, 512, (n, self.seq), generator=torch.Generator().manual_seed(n)).to(device)
        return {"input_ids": ids, "labels": ids}

    @staticmethod
    def step(model, batch):
        model(**batch).loss.backward()

    @staticmethod
    def stock_checkpointed(model):
        return _hf_checkpointing(model)

    @staticmethod
    def stock_offloaded(model):
        return _hf_checkpointing(model, offload=True)


def _hf_checkpointing(model, **offload):
    """transformers' switch, under its name since 5.x or the older one (a GPU machine may have another release)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False}, **offload)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False}, **offload)
    return model


class QLoRA(Llama):
    """The same Llama-like model as QLoRA trains it: every decoder linear layer packed to 4 bits by bitsandbytes
    (nf4, bf16 compute), the rest prepared for k-bit training (peft upcasts it to fp32), LoRA as above."""

    def __init__(self, quick: bool):
        super().__init__(quick)
        self.name = (f"Llama-like QLoRA: decoder linear layers bitsandbytes 4-bit nf4 (bf16 compute), the rest fp32 "
                     f"(`peft.prepare_model_for_kbit_training`) + peft LoRA (q/k/v/o, dropout 0.05), "
                     f"{self.layers} layers, seq {self.seq}")
        self.key = "qlora"

    def build(self, device):
        # bitsandbytes packs the weights as they are loaded onto the device (also on CPU): the model is saved and
        # loaded back with a quantization config, the route users take
        import tempfile

        import bitsandbytes  # noqa: F401 - without it the section says so (run_workload), not transformers' error
        import peft
        import transformers

        quant = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                bnb_4bit_compute_dtype=torch.bfloat16)
        bars, verbosity = transformers.utils.logging.is_progress_bar_enabled(), transformers.logging.get_verbosity()
        transformers.utils.logging.disable_progress_bar()
        transformers.logging.set_verbosity_error()
        try:
            with tempfile.TemporaryDirectory() as path:
                transformers.LlamaForCausalLM(self.config()).to(torch.bfloat16).save_pretrained(path)
                where = "cpu" if device.type == "cpu" else (
                    device.index if device.index is not None else torch.cuda.current_device())
                model = transformers.AutoModelForCausalLM.from_pretrained(
                    path, quantization_config=quant, device_map={"": where}, dtype=torch.bfloat16)
        finally:
            transformers.logging.set_verbosity(verbosity)
            if bars:
                transformers.utils.logging.enable_progress_bar()
        model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
        return self.lora(model)


class ResNet(Workload):
    def __init__(self, quick: bool):
        self.width, self.size = (0.125, 64) if quick else (0.25, 96)
        self.ref = 4 if quick else 16
        self.cap = 16 if quick else 256
        self.name = (f"ResNet-18 (in-repo, width × {self.width}), every parameter trains, batch norm in training "
                     f"mode, {self.size}×{self.size} images")
        self.key = "cnn"

    def build(self, device):
        from slimgrad.cases import apply_case
        from slimgrad.models import build_model

        model = build_model("resnet18", num_classes=10, width_scale=self.width)
        apply_case(model, "all")
        return model.to(device)

    def batch(self, n, device):
        return torch.randn(n, 3, self.size, self.size, generator=torch.Generator().manual_seed(n)).to(device)

    @staticmethod
    def step(model, batch):
        model(batch).sum().backward()

    @staticmethod
    def stock_checkpointed(model):
        return apply_plan(model, {b: "checkpoint" for b in blocks_of(model)})

    @staticmethod
    def stock_offloaded(model):
        """transformers' construct (``save_on_cpu`` around a non-reentrant checkpoint) on every stage: only the
        blocks' inputs go to host memory, the rest is recomputed."""
        apply_plan(model, {b: "checkpoint" for b in blocks_of(model)})
        modules = dict(model.named_modules())
        for b in blocks_of(model):
            modules[b].forward = _on_host(modules[b].forward)
        return model


def _on_host(forward):
    def run(*args, **kwargs):
        with torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()):
            return forward(*args, **kwargs)

    return run


# ---------------------------------------------------------------------------------------------- alternatives

ALTERNATIVES = [
    ("stock", "stock, no memory measure"),
    ("ckpt", "(a) stock + full checkpointing"),
    ("offload", "(b) stock + offloaded checkpointing"),
    ("compile", "(c) torch.compile, activation_memory_budget"),
    ("slim", "(d) slimgrad alone"),
    ("slim+ckpt", "(e) slimgrad + full checkpointing"),
    ("plan", "(f) slimgrad's plan"),
]


def _before_step_bytes(model, batch) -> int:
    """Bytes that exist before a step starts: parameters (a 4-bit weight with its quantization state, which
    ``slimgrad.estimate`` counts as weights too), buffers, the batch (unique storages)."""
    seen, total = set(), 0
    tensors = [t for p in model.parameters() for t in (_packed_tensors(p) or [p])] + list(model.buffers())
    tensors += list(batch.values()) if isinstance(batch, dict) else [batch]
    for t in tensors:
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            # CUDA's caching allocator hands out 512-byte multiples, and the plan's estimate counts them so
            total += -(-s.nbytes() // 512) * 512 if s.device.type == "cuda" else s.nbytes()
    return total


class Bench:
    def __init__(self, work: Workload, device, compile_ok: bool, log):
        self.work, self.device, self.log = work, device, log
        torch.manual_seed(0)
        self.stock = work.build(device)
        self.compile_ok = compile_ok
        self.compiled: dict[float, object] = {}  # fraction -> compiled module
        self.compile_seconds: dict[float, float] = {}
        self.compile_error: dict[float, str] = {}
        self.fixed: dict[str, torch.nn.Module] = {}
        self.plan_notes: dict[tuple, str] = {}
        self.plans: dict[tuple, object] = {}  # (budget, reference size) -> the planned model

    # -- the model of an alternative at a budget and size
    def model(self, alt: str, budget: int, fraction: float, n: int):
        w = self.work
        if alt in ("stock", "ckpt", "offload", "slim", "slim+ckpt"):
            if alt not in self.fixed:
                m = copy.deepcopy(self.stock)
                if alt == "ckpt":
                    m = w.stock_checkpointed(m)
                elif alt == "offload":
                    m = w.stock_offloaded(m)
                elif alt == "slim":
                    m = slimgrad.convert(m)
                elif alt == "slim+ckpt":
                    m = apply_plan(slimgrad.convert(m), {b: "checkpoint" for b in blocks_of(m)})
                self.fixed[alt] = m
            return self.fixed[alt]
        if alt == "compile":
            if fraction in self.compile_error:
                raise RuntimeError(self.compile_error[fraction])
            if fraction not in self.compiled:
                import torch._functorch.config as functorch_config

                torch._dynamo.reset()
                functorch_config.activation_memory_budget = fraction
                compiled = torch.compile(copy.deepcopy(self.stock), dynamic=True)
                batch = w.batch(w.ref, self.device)
                t = time.perf_counter()
                try:
                    w.step(compiled, batch)
                except Exception as exc:  # noqa: BLE001 - record why compile cannot be compared
                    self.compile_error[fraction] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
                    raise RuntimeError(self.compile_error[fraction]) from exc
                finally:
                    functorch_config.activation_memory_budget = 1.0
                self.compile_seconds[fraction] = time.perf_counter() - t
                compiled.zero_grad(set_to_none=True)
                self.compiled[fraction] = compiled
            return self.compiled[fraction]
        if alt == "plan":
            if n == w.ref and (budget, n) in self.plans:
                return self.plans[(budget, n)]
            batch = w.batch(n, self.device)
            m = copy.deepcopy(self.stock)
            whole = budget + _before_step_bytes(m, batch)
            try:
                m, report = slimgrad.convert(m, budget=whole, example=batch, report=True)
                self.plan_notes[(budget, n)] = " ".join(report.plan.notes)
            except ValueError as exc:
                if not str(exc).startswith("convert: slimgrad.plan"):  # not a refusal: the plan could not be made
                    raise
                self.plan_notes[(budget, n)] = str(exc)
                m = None
            if n == w.ref:
                self.plans[(budget, n)] = m
            return m
        raise ValueError(alt)

    def peak(self, alt, budget, fraction, n) -> int | None:
        """Measured step peak of ``alt`` at size n (None: the plan refused the budget at this size)."""
        m = self.model(alt, budget, fraction, n)
        if m is None:
            return None
        batch = self.work.batch(n, self.device)
        m.zero_grad(set_to_none=True)
        self.work.step(m, batch)  # warm-up: first-call caches, a dynamic compile's new size
        m.zero_grad(set_to_none=True)
        # (peak_bytes collects the garbage of earlier steps first: freed inside the measured step, models and graphs
        # in reference cycles would count against it, seen as a 0.3-1 MiB lower first peak of a fresh model)
        if self.device.type == "cuda":
            # a CUDA tensor among the arguments: peak_bytes reads max_memory_allocated alone (a bare closure
            # would also run the CPU profiler's allocation records around every step)
            p = peak_bytes(lambda _on: self.work.step(m, batch), torch.empty(0, device=self.device))
        else:
            p = peak_bytes(lambda: self.work.step(m, batch))
        m.zero_grad(set_to_none=True)
        return p

    def largest(self, alt, budget, fraction, runs: list, seed: int | None = None) -> int:
        """The largest size whose measured step peak is within ``budget`` (0: not even size 1). The search
        starts from ``seed`` where given (each of the plan's candidates costs a plan), else from a linear guess
        through the measured peaks at the reference size and half of it."""
        peaks: dict[int, int | None] = {}

        def fits(n):
            if n not in peaks:
                peaks[n] = self.peak(alt, budget, fraction, n)
                runs.append((alt, fraction, n, peaks[n]))
            return peaks[n] is not None and peaks[n] <= budget

        ref, cap = self.work.ref, self.work.cap
        # a linear guess from two measured sizes (the reference and half of it), then search around it
        fits(ref)
        half = max(1, ref // 2)
        guess = seed
        if guess is None and half != ref:
            fits(half)
            if peaks[ref] is not None and peaks[half] is not None and peaks[ref] > peaks[half]:
                slope = (peaks[ref] - peaks[half]) / (ref - half)
                guess = int(half + (budget - peaks[half]) / slope)
        start = min(max(guess, 1), cap) if guess is not None else ref
        lo, hi = (start, None) if fits(start) else (None, start)
        stride = 1  # gallop away from the guess: +1, +2, +4, ... until the other side is found
        while hi is None:
            if lo >= cap:
                return cap
            n = min(lo + stride, cap)
            if fits(n):
                lo, stride = n, 2 * stride
            else:
                hi = n
        while lo is None:
            if hi <= 1:
                return 0
            n = max(hi - stride, 1)
            if fits(n):
                lo = n
            else:
                hi, stride = n, 2 * stride
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid
        return lo


# ---------------------------------------------------------------------------------------------- timing


def time_configs(work: Workload, configs: dict, device, repeats: int) -> dict:
    """Median step seconds of each config (name -> model) at the reference batch, interleaved rounds."""
    batch = work.batch(work.ref, device)
    names = list(configs)
    for name in names:  # warm-up
        configs[name].zero_grad(set_to_none=True)
        work.step(configs[name], batch)
    times = {name: [] for name in names}
    for i in range(repeats):
        order = names[i % len(names):] + names[: i % len(names)]
        for name in order:
            m = configs[name]
            m.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            work.step(m, batch)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(v) for name, v in times.items()}


# ---------------------------------------------------------------------------------------------- one workload


def run_workload(work: Workload, device, repeats: int, compile_ok: bool, progress, fractions=FRACTIONS,
                 no_compile_why: str = "not run (--no-compile)") -> dict:
    try:
        bench = Bench(work, device, compile_ok, progress)
    except ImportError as exc:  # bitsandbytes (the QLoRA section) is an optional dependency
        return {"work": work, "skipped": f"Not run: {type(exc).__name__}: {exc}."}
    stock_peak = bench.peak("stock", 0, 1.0, work.ref)
    budgets = [(f, int(f * stock_peak)) for f in fractions]
    alts = [a for a, _ in ALTERNATIVES]
    sizes: dict = {}
    ref_peak: dict = {}
    why: dict = {}
    errors: dict = {}  # (alt, fraction) -> the whole first line of an error and where it was raised
    runs: list = []
    for alt in alts:
        for fraction, budget in budgets:
            progress(f"{work.key}: {alt} at {fraction:.0%}")
            if alt == "offload" and device.type != "cuda":
                why[(alt, fraction)] = "n/a on CPU"
                continue
            if alt == "compile" and not compile_ok:
                why[(alt, fraction)] = no_compile_why
                continue
            try:
                start = len(runs)
                seed = None
                if alt == "plan":  # the plan fits about what slimgrad + full checkpointing fits
                    seed = max([sizes.get((a, fraction), 0) for a in ("slim", "slim+ckpt")]) or None
                sizes[(alt, fraction)] = bench.largest(alt, budget, fraction, runs, seed)
                ref_peak[(alt, fraction)] = next(p for a, f, n, p in runs[start:] if n == work.ref)
            except Exception as exc:  # noqa: BLE001 - report the cell and go on
                why[(alt, fraction)] = f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}"
                errors[(alt, fraction)] = _error_line(exc)
    # step time at the reference batch: one timing per distinct configuration
    progress(f"{work.key}: timing at batch {work.ref}")
    configs, key_of = {}, {}
    for alt in alts:
        for fraction, budget in budgets:
            p = ref_peak.get((alt, fraction))
            if p is None or p > budget:
                continue
            if alt == "compile":
                key = f"compile@{fraction}"
                m = bench.compiled[fraction]
            elif alt == "plan":
                m = bench.model("plan", budget, fraction, work.ref)
                acts = tuple(sorted(planned_actions(m).items()))
                every = tuple(sorted((b, "checkpoint") for b in blocks_of(bench.stock)))
                if "chunked loss is on" in bench.plan_notes.get((budget, work.ref), ""):
                    key = f"plan+chunked:{acts}"
                else:
                    key = "slim" if not acts else "slim+ckpt" if acts == every else f"plan:{acts}"
                if key in ("slim", "slim+ckpt"):  # the same configuration: the same model, the same timing
                    m = configs.get(key, bench.model(key, budget, fraction, work.ref))
            else:
                key, m = alt, bench.model(alt, budget, fraction, work.ref)
            configs.setdefault(key, m)
            key_of[(alt, fraction)] = key
    configs.setdefault("stock", bench.model("stock", 0, 1.0, work.ref))
    seconds = time_configs(work, configs, device, repeats)
    plan_actions = {}
    for fraction, budget in budgets:
        try:
            m = bench.model("plan", budget, fraction, work.ref)
        except Exception:  # noqa: BLE001 - the plan's cells already say why
            m = None
        plan_actions[fraction] = planned_actions(m) if m is not None else None
    return {"work": work, "stock_peak": stock_peak, "budgets": budgets, "sizes": sizes, "ref_peak": ref_peak,
            "why": why, "errors": errors, "seconds": seconds, "key_of": key_of, "stock_ms": seconds["stock"] * 1e3,
            "compile_seconds": dict(bench.compile_seconds), "compile_error": dict(bench.compile_error),
            "plan_actions": plan_actions, "plan_notes": bench.plan_notes, "runs": runs, "bench": bench}


# ---------------------------------------------------------------------------------------------- the verdict


def _error_line(exc: BaseException) -> str:
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    where = next((f for f in reversed(frames) if "slimgrad" in f.filename), frames[-1]) if frames else None
    at = f" (raised in {pathlib.Path(where.filename).name}:{where.lineno}, {where.name})" if where else ""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:600]}{at}"


def verdict(r: dict, fraction: float, budget: int) -> str:
    sizes, key_of, seconds = r["sizes"], r["key_of"], r["seconds"]
    plan_n = sizes.get(("plan", fraction))
    others = {a: sizes[(a, fraction)] for a, _ in ALTERNATIVES
              if a not in ("plan", "stock") and (a, fraction) in sizes}
    label = dict(ALTERNATIVES)
    problems = []
    if plan_n is None:
        error = r["errors"].get(("plan", fraction))
        return f"not measured ({error or r['why'].get(('plan', fraction), '?')})"
    best_alt = max(others, key=others.get) if others else None
    if best_alt is not None and others[best_alt] > plan_n:
        cause = _size_cause(r, budget, plan_n + 1)
        problems.append(f"{label[best_alt]} fits batch {others[best_alt]} > the plan's {plan_n}; {cause}")
    fitting = {a: seconds[key_of[(a, fraction)]] for a, _ in ALTERNATIVES
               if a not in ("plan", "stock") and (a, fraction) in key_of}
    plan_key = key_of.get(("plan", fraction))
    if plan_key is None:
        if fitting:
            problems.append(f"the plan does not fit the reference batch, which {', '.join(label[a] for a in fitting)}"
                            f" fit{'s' if len(fitting) == 1 else ''}; {_size_cause(r, budget, r['work'].ref)}")
    elif fitting:
        fastest = min(fitting, key=fitting.get)
        plan_s = seconds[plan_key]
        if plan_s > fitting[fastest] and key_of[(fastest, fraction)] != plan_key:
            problems.append(f"the plan's step ({plan_s * 1e3:.0f} ms) is slower than {label[fastest]} "
                            f"({fitting[fastest] * 1e3:.0f} ms){_time_cause(r, fastest, fraction)}")
    if not problems:
        return "holds"
    return "does not hold: " + "; ".join(problems)


def _size_cause(r: dict, budget: int, n: int) -> str:
    """Why the plan does not fit size n: what slimgrad.plan says there (the lowest peak and its place)."""
    work, bench = r["work"], r["bench"]
    batch = work.batch(n, bench.device)
    m = slimgrad.convert(copy.deepcopy(bench.stock))
    try:
        p = slimgrad.plan(m, budget + _before_step_bytes(m, batch), batch)
    except Exception as exc:  # noqa: BLE001 - the verdict still names the miss
        return f"the cause was not measured (slimgrad.plan: {_error_line(exc)})"
    return (f"at batch {n} the smallest step peak any plan reaches is "
            f"{(p.smallest_feasible - _before_step_bytes(m, batch)) / MiB:.1f} MiB > the budget "
            f"{budget / MiB:.1f} MiB, peak at {p.estimate_after.peak_where}")


def _time_cause(r: dict, fastest: str, fraction: float) -> str:
    if fastest == "compile":
        return " (compiled kernels: the plan runs eager)"
    return ""


# ---------------------------------------------------------------------------------------------- output


def _acts_text(acts: dict, block_paths: list[str], n_blocks: int) -> list[str]:
    """"checkpoints 1 of 4 blocks", "checkpoints the mlp of 3 blocks", ... (the plan's actions on blocks and on
    their parts). The stock model's paths name the same modules as the planned model's up to a prefix."""
    texts = []
    for verb, action in (("checkpoints", "checkpoint"), ("offloads", "offload")):
        whole = sum(1 for p, a in acts.items() if a == action and any(p.endswith(b) for b in block_paths))
        parts: dict[str, int] = {}
        for p, a in acts.items():
            if a == action and not any(p.endswith(b) for b in block_paths):
                name = p.rsplit(".", 1)[-1]
                parts[name] = parts.get(name, 0) + 1
        if whole:
            texts.append(f"{verb} {whole} of {n_blocks} blocks")
        texts += [f"{verb} the {name} of {n} block{'s' if n > 1 else ''}" for name, n in sorted(parts.items())]
    return texts


def table(r: dict) -> list[str]:
    work = r["work"]
    if "skipped" in r:
        return [f"### {work.name}", "", r["skipped"], ""]
    lines = [f"### {work.name}", "",
             f"Stock's step peak at batch {work.ref}: {r['stock_peak'] / MiB:.1f} MiB, step {r['stock_ms']:.0f} ms. "
             f"Budgets: " + ", ".join(f"{f:.0%} = {b / MiB:.1f} MiB" for f, b in r["budgets"]) + ".", ""]
    head = "| alternative | " + " | ".join(f"{f:.0%}: largest {work.size_name} | {f:.0%}: ms at {work.ref}"
                                            for f, _ in r["budgets"]) + " |"
    lines += [head, "|---|" + "---:|---:|" * len(r["budgets"])]
    for alt, label in ALTERNATIVES:
        cells = []
        for fraction, _budget in r["budgets"]:
            if (alt, fraction) in r["why"]:
                cells += [r["why"][(alt, fraction)], "–"]
                continue
            n = r["sizes"].get((alt, fraction))
            p = r["ref_peak"].get((alt, fraction))
            size = f"{n}" + ("+ (cap)" if n == work.cap else "") if n else "none"
            if (alt, fraction) in r["key_of"]:
                ms = f"{r['seconds'][r['key_of'][(alt, fraction)]] * 1e3:.0f}"
            elif p is None:
                ms = "plan refused"
            else:
                ms = f"does not fit ({p / MiB:.1f} MiB)"
            cells += [size, ms]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append("")
    if r["compile_seconds"] or r["compile_error"]:
        lines.append("Compile time (first step, `dynamic=True`; Inductor's on-disk cache from an earlier run shortens "
                     "it, the first run on a machine takes longer): " + ", ".join(
            f"{f:.0%}: {s:.0f} s" for f, s in sorted(r["compile_seconds"].items()))
            + "".join(f"; {f:.0%}: failed ({e})" for f, e in sorted(r["compile_error"].items())) + ".")
    lines.append("")
    lines.append("<details><summary>every measured step (batch: MiB above the step's start)</summary>")
    lines.append("")
    for alt, label in ALTERNATIVES:
        for fraction, budget in r["budgets"]:
            seen = [(n, p) for a, f, n, p in r["runs"] if a == alt and f == fraction]
            if seen:
                steps = ", ".join(f"{n}: {'refused' if p is None else f'{p / MiB:.2f}'}" for n, p in seen)
                lines.append(f"- {label}, {fraction:.0%} ({budget / MiB:.2f} MiB): {steps}")
    lines += ["", "</details>", ""]
    for fraction, budget in r["budgets"]:
        acts = r["plan_actions"].get(fraction)
        chunked = "chunked loss is on" in r["plan_notes"].get((budget, work.ref), "")
        block_paths = blocks_of(r["bench"].stock)
        n_blocks = len(block_paths)
        desc = ("not made (an error, in the plan's cell)" if ("plan", fraction) in r["errors"] else
                "refused at the reference batch" if acts is None else
                "nothing checkpointed" + (", chunked loss" if chunked else " (slimgrad alone fits)") if not acts
                else ", ".join(_acts_text(acts, block_paths, n_blocks)) + (", chunked loss" if chunked else ""))
        lines.append(f"- {fraction:.0%} ({budget / MiB:.1f} MiB): plan at batch {work.ref}: {desc}. "
                     f"Target: {verdict(r, fraction, budget)}.")
    return lines


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (one GPU: peaks from max_memory_allocated)")
    parser.add_argument("--repeats", type=int, default=7, help="interleaved timing rounds")
    parser.add_argument("--only", default="", help="comma-separated: llama, qlora, cnn")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile (minutes of compile time)")
    parser.add_argument("--compile", action="store_true", help="with --quick: run torch.compile all the same")
    parser.add_argument("--quick", action="store_true",
                        help="the 50 %% budget only, no compile, and on CPU tiny sizes: a smoke run (a minute or two)")
    parser.add_argument("--write", action="store_true", help="write the tables to --out")
    parser.add_argument("--out", default=str(DOC), help="where --write puts them (default: docs/budget.md; a GPU "
                        "run: docs/budget_gpu.md)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch.cuda.is_available() is False on this machine")
    if device.type not in ("cpu", "cuda"):
        parser.error(f"--device must be cpu or cuda, got {args.device!r}")
    torch.set_num_threads(1)
    logging.getLogger("slimgrad").setLevel(logging.ERROR)  # each plan is logged; the tables say what they chose
    only = {k for k in args.only.split(",") if k}
    unknown = only - {"llama", "qlora", "cnn"}
    if unknown:
        parser.error(f"--only takes llama, qlora, cnn; got {', '.join(sorted(unknown))}")
    # a GPU steps the published sizes in milliseconds: --quick there keeps them (the tables then compare with the
    # CPU ones) and drops only the 25 % / 75 % budgets and compile; on CPU it also shrinks the models
    tiny = args.quick and device.type == "cpu"
    works = [w for w in (Llama(tiny), QLoRA(tiny), ResNet(tiny)) if not only or w.key in only]
    repeats = 3 if args.quick else args.repeats
    compile_ok = not args.no_compile and (args.compile or not args.quick)
    no_compile_why = "not run (--no-compile)" if args.no_compile else "not run (--quick)"
    started = time.perf_counter()

    def progress(what):
        print(f"\r[{time.perf_counter() - started:5.0f} s] {what}" + " " * 30, end="", file=sys.stderr, flush=True)

    fractions = (0.5,) if args.quick else FRACTIONS
    results = []
    for w in works:
        t = time.perf_counter()
        try:
            results.append(run_workload(w, device, repeats, compile_ok, progress, fractions, no_compile_why))
        except Exception as exc:  # noqa: BLE001 - one section's failure must not cost the others (a GPU run is rare)
            import traceback

            where = traceback.extract_tb(exc.__traceback__)[-1]
            results.append({"work": w, "skipped": f"Failed: {type(exc).__name__}: {str(exc).splitlines()[0][:300]} "
                            f"(at {pathlib.Path(where.filename).name}:{where.lineno})."})
        results[-1]["wall_seconds"] = time.perf_counter() - t
    total = time.perf_counter() - started
    print(f"\r[{total:5.0f} s] done" + " " * 60, file=sys.stderr)

    cmd = "python benchmarks/budget.py " + " ".join(argv if argv is not None else sys.argv[1:])
    cuda = device.type == "cuda"
    machine = (f"{torch.cuda.get_device_name(device)} (CUDA {torch.version.cuda}), 1 CPU thread" if cuda
               else f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, 1 thread")
    versions = ", ".join(f"{name} {_version(name)}" for name in ("transformers", "peft", "bitsandbytes"))
    from slimgrad import csrc

    core = csrc.status()
    versions += "; slimgrad's compiled core " + (
        "loaded" if core["loaded"] else f"not loaded ({core['reason'] or 'not used'})")
    lines = ["# Fitting a memory budget: slimgrad's plan against the alternatives", "",
             f"`OMP_NUM_THREADS=1 {cmd.strip()}` — torch {torch.__version__}, {versions}; {machine}; "
             f"{time.strftime('%Y-%m-%d')}, {total:.0f} s in all ("
             + ", ".join(f"{r['work'].key}: {r['wall_seconds']:.0f} s" for r in results) + ").", "",
             f"Budgets are {' / '.join(f'{f:.0%}' for f in fractions)} of stock's step peak at the reference "
             "batch (the peak above the step's start: `slimgrad.peak_bytes` around one forward + backward, "
             + ("`torch.cuda.max_memory_allocated` on the GPU" if cuda else "the profiler's allocator records on CPU")
             + "). *Largest batch*: the largest batch whose measured step peak fits the "
             "budget, found by measured steps (from a linear guess through the reference batch and half of it, "
             "or for the plan from what slimgrad with or without full checkpointing fits: steps of +1, +2, +4 ... "
             "away from it, then bisection); the Llamas' sequence length is fixed. *ms*: median step time "
             "(forward + backward) at the reference batch over interleaved "
             f"rounds ({repeats}), or *does not fit* with the measured peak there. Each plan is made for the "
             "batch it runs: `slimgrad.convert(model, budget=step budget + weights + batch, example=batch)` (convert "
             "budgets everything on the device; these budgets are above the step's start), which may also turn on "
             "the chunked loss where that fits with less recomputation (the plan line says so)"
             + ("; on the GPU its blocks may also offload their kept tensors to pinned host memory (the plan's "
                "default actions, checkpoint and offload, costed by a measured forward and a measured round trip "
                "of the kept tensors)" if cuda else "")
             + ". Garbage is collected before each measured step.",
             "",
             "Full checkpointing: transformers' `activation_checkpointing_enable(activation_checkpointing_kwargs="
             "{\"use_reentrant\": False})` (what `gradient_checkpointing_enable` calls) on the Llamas; "
             "`apply_plan` (`from slimgrad.plan import apply_plan`) with every block \"checkpoint\" (non-reentrant) "
             "on the stock ResNet, "
             "which has no checkpointing switch of its own. Offloaded checkpointing: transformers' "
             "`offload=True` (`save_on_cpu(pin_memory=True)` around each layer's checkpoint: the layers' inputs go "
             "to host memory) on the Llamas, the same construct around each stage of the ResNet"
             + ("." if cuda else "; n/a on CPU: the device memory *is* host memory, nothing leaves it.")
             + " torch.compile: `torch._functorch.config.activation_memory_budget` = the "
             "budget's fraction (of the compiled graph's activation memory, not of the peak), `dynamic=True` "
             "so each budget compiles once; over the QLoRA model it compiles bitsandbytes' 4-bit ops too.", ""]
    for r in results:
        lines += table(r) + [""]
    text = "\n".join(lines).rstrip() + "\n"
    print(text)
    if args.write:
        pathlib.Path(args.out).write_text(text)
    return text


def _version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


if __name__ == "__main__":
    main()

"""Per-call overhead of slimgrad's layers: where they keep what stock keeps (stock's op runs) and where they save
(the compiled core's Function runs; the Python path's Function where the core is disabled or unavailable).

    OMP_NUM_THREADS=1 python benchmarks/call_overhead.py [--repeats 2000] [--write]
    OMP_NUM_THREADS=1 python benchmarks/call_overhead.py --core off --rounds 5 [--only relu,lora]

``--core off`` measures only stock against the Python path (what runs on CUDA, where the core does not serve:
each saving layer's Python Function), with rows for the families CUDA runs there (peft LoRA with "seed"
dropout, the mask activations in place and not, frozen-weight conv, batch norm, max pool, RMSNorm, the gated
activation); ``--rounds`` repeats the interleaved measurement and reports the median of the rounds' medians.

``--device cuda`` (a lent GPU) runs the same rows on CUDA tensors: with tiny tensors the GPU finishes each kernel
long before the host has launched the next, so the wall time of a call is its host time, the cost that makes
small-batch CUDA steps host-bound. The core column is then what the core serves on CUDA (conv, batch norm, average
pooling, LoRA without dropout), the rest running their Python Functions and Triton kernels.

Tiny tensors, so the time is the Python and autograd bookkeeping around the kernels: forward + backward
of one layer, stock vs converted with the core vs converted with the core disabled (``slimgrad.csrc.disabled``),
interleaved call by call; median over ``--repeats`` calls, reported as slimgrad minus stock in microseconds.
Issue 22's target for the core: at most 5 µs over stock per call. ``--write`` puts the table into
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import platform
import statistics
import sys
import time

import torch
from torch import nn

import slimgrad
from slimgrad import csrc

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
from _docs import write_section  # noqa: E402


class _KeepInput(torch.autograd.Function):
    """A consumer that keeps its input (as a trainable conv would): makes a ReLU learn to keep its output."""

    @staticmethod
    def forward(ctx, x):
        slimgrad.functional._common.note_input_kept(x)
        ctx.save_for_backward(x)
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g


def _bias_only(norm: nn.Module) -> nn.Module:
    norm.weight.requires_grad_(False)
    return norm


def _cases():
    x4 = lambda: torch.randn(2, 4, 6, 6)  # noqa: E731
    yield "Conv2d, weight trains", nn.Conv2d(4, 4, 3, padding=1), x4, False
    yield "Conv2d, weight trains, X needs grad", nn.Conv2d(4, 4, 3, padding=1), x4, True
    yield "BatchNorm2d train, all train", nn.BatchNorm2d(4), x4, True
    bn = nn.BatchNorm2d(4).eval()
    yield "BatchNorm2d eval, weight trains", bn, x4, True
    yield "ReLU, consumer keeps output", nn.Sequential(nn.ReLU()), x4, True
    yield "ReLU(inplace), consumer keeps output", nn.Sequential(nn.ReLU(inplace=True)), x4, True
    # layer/group norm keep x, mean and rstd wherever x or the weight needs grad, as stock does: stock's op runs
    yield "LayerNorm frozen, X needs grad", nn.LayerNorm(16).requires_grad_(False), lambda: torch.randn(2, 8, 16), True
    yield "GroupNorm frozen, X needs grad", nn.GroupNorm(2, 4).requires_grad_(False), x4, True
    # Where slimgrad saves (its Function runs): the per-call price of the saving on a tiny tensor.
    frozen = nn.Conv2d(4, 4, 3, padding=1).requires_grad_(False)
    yield "[Function] Conv2d frozen, X needs grad", frozen, x4, True
    yield "[Function] BatchNorm2d eval, frozen", nn.BatchNorm2d(4).eval().requires_grad_(False), x4, True
    yield "[Function] ReLU, 1-bit mask", nn.ReLU(), x4, True
    yield "[Function] LeakyReLU, 1-bit mask", nn.LeakyReLU(0.1), x4, True
    yield "[Function] Hardtanh, 1-bit mask", nn.Hardtanh(), x4, True
    yield "[Function] MaxPool2d 3/2", nn.MaxPool2d(3, 2, 1), x4, True
    yield "[Function] ConvTranspose2d frozen, X needs grad", nn.ConvTranspose2d(4, 4, 3).requires_grad_(False), x4, True
    yield "[Function] Dropout(0.1) fp32", nn.Dropout(0.1), x4, True
    yield "[Function] Dropout(0.1) bf16", nn.Dropout(0.1), lambda: x4().bfloat16(), True
    xs = lambda: torch.randn(2, 8, 16)  # noqa: E731
    yield "[Function] RMSNorm frozen, X needs grad", nn.RMSNorm(16).requires_grad_(False), xs, True
    yield "[Function] LayerNorm, bias trains only", _bias_only(nn.LayerNorm(16)), xs, False
    yield "[Function] GroupNorm, bias trains only", _bias_only(nn.GroupNorm(2, 4)), x4, False
    yield "[Function] gated silu(gate) * up", _Gated(False), xs, True
    yield "[Function] FusedAddRMSNorm, weight trains, X needs grad", _FusedAdd(False), xs, True
    lora = _peft_lora()
    if lora is not None:
        # x frozen and read by the layer alone: peft's own forward runs (its graph keeps as little as the Function)
        yield "peft LoRA Linear r=4, dropout 0.1, X frozen (peft's forward)", lora, xs, False
        yield "[Function] peft LoRA Linear r=4, dropout 0.1, X needs grad", _peft_lora(), xs, True
        yield "peft LoRA Conv2d r=4, dropout 0.1, X frozen (peft's forward)", _peft_lora_conv(0.1), x4, False
        yield "[Function] peft LoRA Conv2d r=4, dropout 0.1, X needs grad", _peft_lora_conv(0.1), x4, True
        yield ("[Function] peft LoRA Conv2d r=4, bf16 model, fp32 adapters", _peft_lora_conv(0.0, torch.bfloat16),
               lambda: x4().bfloat16(), False)


def _python_path_cases():
    """The families that run their Python Function on CUDA (the core serves CPU tensors only), as CUDA runs them:
    dropout with the "seed" policy (CUDA's default), so the Python path's per-call cost is measured on CPU."""
    x4 = lambda: torch.randn(2, 4, 6, 6)  # noqa: E731
    xs = lambda: torch.randn(2, 8, 16)  # noqa: E731
    lora = _peft_lora()
    if lora is not None:
        yield "peft LoRA Linear r=4, dropout 0.1 (seed)", lora, xs, False, "seed"
        yield "peft LoRA Linear r=4, dropout 0.1, X needs grad (seed)", _peft_lora(), xs, True, "seed"
        yield "peft LoRA Conv2d r=4, dropout 0.1 (seed)", _peft_lora_conv(0.1), x4, False, "seed"
    yield "Dropout(0.1) fp32 (seed)", nn.Dropout(0.1), x4, True, "seed"
    yield "ReLU, 1-bit mask", nn.ReLU(), x4, True, None
    yield "ReLU(inplace), 1-bit mask", nn.ReLU(inplace=True), x4, True, None
    yield "LeakyReLU, 1-bit mask", nn.LeakyReLU(0.1), x4, True, None
    yield "ReLU6, 1-bit mask", nn.ReLU6(), x4, True, None
    yield "Conv2d frozen, X needs grad", nn.Conv2d(4, 4, 3, padding=1).requires_grad_(False), x4, True, None
    yield "BatchNorm2d eval, frozen", nn.BatchNorm2d(4).eval().requires_grad_(False), x4, True, None
    bn = nn.BatchNorm2d(4)
    bn.weight.requires_grad_(False)
    yield "BatchNorm2d train, weight frozen, X no grad", bn, x4, False, None
    yield "MaxPool2d 3/2", nn.MaxPool2d(3, 2, 1), x4, True, None
    yield "RMSNorm frozen, X needs grad", nn.RMSNorm(16).requires_grad_(False), xs, True, None
    yield "RMSNorm, weight trains, X needs grad", nn.RMSNorm(16), xs, True, None
    llama = _llama_rms_norm()
    if llama is not None:
        yield "LlamaRMSNorm, weight trains, X needs grad", llama, xs, True, None
    yield "gated silu(gate) * up", _Gated(False), xs, True, None
    yield "FusedAddRMSNorm, weight trains, X needs grad", _FusedAdd(False), xs, True, None


class _Gated(nn.Module):
    """``silu(gate) * up`` on a split input: stock's expression, or slimgrad's gated_activation (``slim``)."""

    def __init__(self, slim: bool):
        super().__init__()
        self.slim = slim

    def forward(self, x):
        gate, up = x, x * 2.0
        if self.slim:
            return slimgrad.functional.gated_activation(gate, up, "silu")
        return torch.nn.functional.silu(gate) * up


class _FusedAdd(nn.Module):
    """``(norm(x + r), x + r)`` with r = x / 2 (hidden 16, Llama's casting): stock's formula differentiated by autograd
    (FusedAddRMSNormFunction.stock), or slimgrad's fused_add_rms_norm (``slim``). Returns the sum of both outputs."""

    def __init__(self, slim: bool):
        super().__init__()
        self.slim = slim
        self.weight = nn.Parameter(torch.ones(16))

    def forward(self, x):
        from slimgrad.functional.norms import FusedAddRMSNormFunction, fused_add_rms_norm

        r = x * 0.5
        fn = fused_add_rms_norm if self.slim else FusedAddRMSNormFunction.stock
        y, s = fn(x, r, self.weight, 1e-6, "llama")
        return y + s


def _llama_rms_norm():
    """transformers' LlamaRMSNorm (hidden 16), None without transformers."""
    try:
        from transformers.models.llama.modeling_llama import LlamaRMSNorm
    except ImportError:
        return None
    return LlamaRMSNorm(16)


def _peft_lora():
    """A peft LoRA linear (frozen base, trainable adapters, dropout 0.1); None without peft."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        return None
    net = nn.Sequential(nn.Linear(16, 16))
    model = get_peft_model(net, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["0"]))
    return model.base_model.model[0]


def _peft_lora_conv(dropout, dtype=None):
    """A peft LoRA Conv2d 4->4, 3x3 (frozen base, trainable adapters r=4); ``dtype``: the model's, with fp32
    adapters (diffusers' mixed precision); None without peft."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        return None
    net = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1))
    model = get_peft_model(net, LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=["0"]))
    layer = model.base_model.model[0]
    if dtype is not None:
        layer.base_layer.to(dtype)
    return layer


def _step(module, x, keep):
    h = x * 1.0 if x.requires_grad else x
    out = module(h)
    if keep:
        out = _KeepInput.apply(out)
    out.sum().backward()


def _convert(stock, policy):
    if isinstance(stock, _Gated):
        return _Gated(True)
    if isinstance(stock, _FusedAdd):
        slim = _FusedAdd(True)
        slim.load_state_dict(stock.state_dict())
        return slim
    return slimgrad.convert(copy.deepcopy(stock), **({} if policy is None else {"dropout": policy}))


_CLOCK = time.perf_counter


def _round(stock, slim, x, keep, repeats, with_core):
    """One interleaved round: per provider, the median of ``repeats`` calls (seconds; on CUDA, host time: the
    queue is drained before the round and not inside it)."""
    if x.is_cuda:
        torch.cuda.synchronize()
    clock = _CLOCK
    ts = {"stock": [], "core": [], "python": []}
    providers = (("stock", stock, True),) + ((("core", slim, True),) if with_core else ()) + (
        ("python", slim, False),)
    for _ in range(repeats):
        for key, m, core in providers:
            with contextlib.nullcontext() if core else csrc.disabled():
                t = clock()
                _step(m, x, keep)
                ts[key].append(clock() - t)
    return {k: (statistics.median(v) if v else float("nan")) for k, v in ts.items()}


def measure(repeats: int, rounds: int = 1, with_core: bool = True, only=None, device: str = "cpu"):
    rows = []
    cases = ((*c, None) for c in _cases()) if with_core else _python_path_cases()
    for name, stock, make_x, x_grad, policy in cases:
        if only and not any(o.lower() in name.lower() for o in only):
            continue
        stock = stock.to(device)
        slim = _convert(stock, policy).to(device)
        keep = "consumer keeps" in name
        x = make_x().to(device).requires_grad_(x_grad)
        for m in (stock, slim):
            for _ in range(20):  # warm-up (and the ReLU learns that its output is kept)
                with contextlib.nullcontext() if with_core else csrc.disabled():
                    _step(m, x, keep)
        per_round = [_round(stock, slim, x, keep, repeats, with_core) for _ in range(rounds)]
        rows.append((name, *(statistics.median(r[k] for r in per_round) * 1e6 for k in ("stock", "core", "python"))))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds; the median of their medians")
    parser.add_argument("--core", choices=("on", "off"), default="on",
                        help="off: stock against the Python path only, on the rows CUDA runs in Python")
    parser.add_argument("--only", default="", help="comma-separated substrings of the row names to run")
    parser.add_argument("--clock", choices=("wall", "thread"), default="wall",
                        help="thread: this thread's CPU time (steadier on a shared machine)")
    parser.add_argument("--device", default="cpu", help="cuda: the rows on CUDA tensors (host time per call)")
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    only = [o for o in args.only.split(",") if o]
    global _CLOCK
    _CLOCK = time.thread_time if args.clock == "thread" else time.perf_counter
    rows = measure(args.repeats, args.rounds, args.core == "on", only, args.device)
    if args.device != "cpu":
        lines = [
            f"## Per-call host time on {args.device}",
            "",
            f"`python benchmarks/call_overhead.py --device {args.device} --core {args.core} --repeats {args.repeats} "
            f"--rounds {args.rounds}` — {torch.cuda.get_device_name()}, torch {torch.__version__}. One layer, "
            f"forward + backward, tiny input: wall time per call, which is host time here (module docstring).",
            "",
            "| layer | stock µs | slimgrad µs (core on) | overhead µs (core on) | overhead µs (Python path) |",
            "|---|---:|---:|---:|---:|",
        ]
        for name, s, g, p in rows:
            lines.append(f"| {name} | {s:.1f} | {g:.1f} | {g - s:+.1f} | {p - s:+.1f} |")
        print("\n".join(lines))
        return
    if args.core == "off":
        clock = "the thread's CPU time" if args.clock == "thread" else "wall time"
        lines = [
            "## Per-call overhead of the Python path",
            "",
            f"`OMP_NUM_THREADS=1 python benchmarks/call_overhead.py --core off --repeats {args.repeats} "
            f"--rounds {args.rounds} --clock {args.clock}` — torch {torch.__version__}, {platform.machine()}, "
            f"{torch.get_num_threads()} thread(s). One layer, forward + backward, on a tiny input (2x4x6x6, "
            f"2x8x16), {clock}: median of {args.rounds} rounds' medians of {args.repeats} interleaved calls. The "
            f"Python path (the core disabled) is what CUDA runs for these families (on CUDA the core serves only "
            f"its aten-only families, see `python -m slimgrad kernels`); dropout and LoRA use the \"seed\" "
            f"policy, CUDA's default. The kernels inside are the CPU ones, not Triton's, so their share differs on "
            f"CUDA; the Python bookkeeping around them is the same.",
            "",
            "| layer | stock µs | Python path µs | overhead µs |",
            "|---|---:|---:|---:|",
        ]
        for name, s, _, p in rows:
            lines.append(f"| {name} | {s:.1f} | {p:.1f} | {p - s:+.1f} |")
        text = "\n".join(lines)
        print(text)
        if args.write:
            write_section("call-overhead-python", text)
        return
    status = csrc.status()
    core_note = "loaded" if status["loaded"] else f"unavailable ({status['reason']})"
    lines = [
        "## Per-call overhead",
        "",
        f"`OMP_NUM_THREADS=1 python benchmarks/call_overhead.py --repeats {args.repeats}` — torch "
        f"{torch.__version__}, {platform.machine()}, {torch.get_num_threads()} thread(s). One layer on a "
        f"2x4x6x6 input, forward + backward (+ the step's own `x * 1.0` and `sum`), median of "
        f"{args.repeats} interleaved calls. Where slimgrad would keep what stock keeps, the converted "
        f"layer calls stock's op itself; what remains is the check (and, for ReLU, the producer bookkeeping "
        f"and a gradient hook). Rows marked [Function] are calls where slimgrad saves memory and its autograd "
        f"Function runs (the compiled core's C++ Function; with the core disabled, the Python Function): their "
        f"overhead is the per-call price of the saving. Core: {core_note}.",
        "",
        "| layer | stock µs | slimgrad µs (core) | overhead µs (core) | overhead µs (Python path) |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, s, g, p in rows:
        lines.append(f"| {name} | {s:.1f} | {g:.1f} | {g - s:+.1f} | {p - s:+.1f} |")
    text = "\n".join(lines)
    print(text)
    if args.write:
        write_section("call-overhead", text)


if __name__ == "__main__":
    main()

"""Bytes kept for backward under torch.func (per-sample gradients, ``vmap(grad(loss))`` over
``functional_call``, the DP-SGD recipe), stock vs slimgrad, and what slimgrad keeps in eager for the same
batch; median time of the vmap(grad) call (interleaved pairs).

Saved-tensor hooks are refused inside ``torch.func.grad``, so the bytes are read from the autograd graph
behind the model's output (``slimgrad.measure.saved_in_graph``: the whole batch's storages, parameters
excluded; 0-d tensors left out: functorch saves a Python-number factor as a 0-d fp64 tensor where eager keeps a
number). Batch norms run in eval (per-sample training requires it; stock fails under vmap in training mode).
The MemSave cases (``slimgrad.cases``) set which gradients are requested: "all" (every parameter, input
constant), "input" (the input only), "norm" (normalisation layers only), "surgical" (the last blocks).

    python benchmarks/func_bytes.py --model resnet18 --cases all,input,norm,surgical
    python benchmarks/func_bytes.py --lora
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

import slimgrad
from slimgrad.cases import apply_case
from slimgrad.measure import saved_in_graph
from slimgrad.models.cnn import build_model


def _per_sample(model, x, input_grad, loss_of):
    """(MiB the graph keeps under vmap(grad) on the first call, the call) for per-sample gradients of the
    trainable parameters, or of the input when ``input_grad``."""
    params = {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}
    frozen = {k: v.detach() for k, v in model.named_parameters() if not v.requires_grad}
    buffers = dict(model.named_buffers())
    kept = []

    def loss(p, xi, count):
        out = functional_call(model, ({**p, **frozen}, buffers), (xi.unsqueeze(0),))
        if count:
            kept.append(sum(r.nbytes for r in saved_in_graph(out, exclude=[model]) if r.shape))
        return loss_of(out)

    def run(count=False):
        return vmap(grad(lambda p, xi: loss(p, xi, count), argnums=1 if input_grad else 0), in_dims=(None, 0))(
            params, x)

    run(count=True)
    return kept[-1] / 2**20, run


def _eager(model, x, input_grad):
    """MiB eager slimgrad (or stock) keeps for the same batch, on a fresh copy (a first call, as above)."""
    return slimgrad.saved_bytes(copy.deepcopy(model), x.clone().requires_grad_(input_grad)) / 2**20


def _row(label, stock, slim, x, input_grad, loss_of):
    eager = _eager(slim, x, input_grad)
    (b0, run0), (b1, run1) = _per_sample(stock, x, input_grad, loss_of), _per_sample(slim, x, input_grad, loss_of)
    times = ([], [])
    for i in range(6):  # interleaved pairs, alternating which runs first: the machine is shared and noisy
        for k in ((0, 1) if i % 2 else (1, 0)):
            t0 = time.perf_counter()
            (run0, run1)[k]()
            times[k].append(time.perf_counter() - t0)
    t0, t1 = (statistics.median(t) * 1e3 for t in times)
    print(f"| {label} | {b0:.3f} | {b1:.3f} | {eager:.3f} | {b1 / b0:.2f} | {t0:.0f} | {t1:.0f} |", flush=True)


def cnn(args):
    torch.manual_seed(0)
    base = build_model(args.model, width_scale=args.width_scale, num_classes=10)
    x = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
    for case in args.cases.split(","):
        model = copy.deepcopy(base)
        input_grad = apply_case(model, case)
        model.eval()
        _row(f"{args.model} {case}", model, slimgrad.convert(copy.deepcopy(model)), x, input_grad,
             lambda out: out.logsumexp(-1).sum())


def lora(args):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

    cfg = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4, num_attention_heads=4)

    class Block(nn.Module):
        """Pre-norm MLP half of a Llama decoder layer."""

        def __init__(self):
            super().__init__()
            self.norm, self.mlp = LlamaRMSNorm(cfg.hidden_size), LlamaMLP(cfg)

        def forward(self, x):
            return x + self.mlp(self.norm(x))

    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        stock = get_peft_model(nn.Sequential(Block(), Block()).to(dtype),
                               LoraConfig(r=8, target_modules=["gate_proj", "up_proj", "down_proj"]))
        slim = slimgrad.convert(copy.deepcopy(stock))
        x = torch.randn(args.batch_size, args.seq, cfg.hidden_size, dtype=dtype)
        for input_grad in (False, True):
            s, m = copy.deepcopy(stock), copy.deepcopy(slim)
            if input_grad:
                s.requires_grad_(False)
                m.requires_grad_(False)
            label = f"Llama MLP blocks + LoRA, {str(dtype)[6:]}, {'input' if input_grad else 'adapters'}"
            _row(label, s, m, x, input_grad, lambda out: out.float().square().mean())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--cases", default="all,input,norm,surgical")
    parser.add_argument("--width-scale", type=float, default=0.25)
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lora", action="store_true", help="the Llama MLP + LoRA blocks instead of a CNN")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--seq", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| model, case | stock vmap(grad) MiB | slimgrad vmap(grad) MiB | slimgrad eager MiB | ratio | stock ms | "
          "slimgrad ms |")
    print("|---|---|---|---|---|---|---|")
    lora(args) if args.lora else cnn(args)


if __name__ == "__main__":
    main()

"""``python -m slimgrad ...``: the demo, the audit and the kernel table.

Errors a user can cause (unknown model, bad shape, a factory that raises) end in one line on stderr and
exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import sys
import time

import torch

from . import convert
from .audit import AUDIT_CASES
from .cases import CASES, apply_case, training_step
from .measure import SavedTensors
from .models import MODELS, build_model


def _mib(n: int) -> str:
    return f"{n / 2**20:8.1f}"


def kept_bytes(model: torch.nn.Module, x: torch.Tensor, input_grad: bool) -> int:
    """Bytes kept for backward by one forward of ``model`` (after a warm-up step, as in training)."""
    training_step(model, x, input_grad)  # warm-up: slimgrad layers learn what their consumers keep
    xi = x.detach().requires_grad_(input_grad)
    with SavedTensors(exclude=[model]) as counter:
        out = model(xi)
    out.float().sum().backward()
    return counter.bytes


def demo(args) -> int:
    torch.manual_seed(0)
    base = build_model(args.model, num_classes=10)
    x = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
    print(f"slimgrad demo: {args.model}-like CNN, input {tuple(x.shape)}, torch {torch.__version__}")
    print("bytes kept for backward by one training forward (MiB), stock PyTorch vs slimgrad.convert:")
    print(f"{'case':<15}{'stock':>10}{'slimgrad':>10}{'ratio':>8}")
    for case in args.cases:
        stock = copy.deepcopy(base)
        input_grad = apply_case(stock, case)
        slim = convert(stock)  # a converted deep copy: same flags and modes
        s, g = kept_bytes(stock, x, input_grad), kept_bytes(slim, x, input_grad)
        print(f"{case:<15}{_mib(s):>10}{_mib(g):>10}{g / s if s else float('nan'):8.3f}")
    return 0


class UserError(Exception):
    """A problem with what the user asked for: reported in one line."""


class _Progress:
    """Numbered steps with elapsed time on stderr, so a long audit shows it is alive."""

    def __init__(self, total: int, quiet: bool):
        self.total, self.done, self.quiet, self.start = total, 0, quiet, time.perf_counter()

    def step(self, what: str) -> None:
        self.done += 1
        if not self.quiet:
            elapsed = time.perf_counter() - self.start
            print(f"[{self.done}/{self.total} {elapsed:5.1f}s] {what}", file=sys.stderr, flush=True)


_HF_CONFIGS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                                                      num_attention_heads=4, num_key_value_heads=4,
                                                      vocab_size=4096)),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_embd=256, n_layer=2, n_head=4, vocab_size=4096)),
    "bert": ("BertConfig", "BertModel", dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                                             intermediate_size=1024, vocab_size=4096)),
}


def _build_audit_target(args):
    """(model, example inputs) for the audit, from --model, --hf or --factory."""
    dtype = getattr(torch, args.dtype)
    if args.factory:
        module_name, _, attr = args.factory.partition(":")
        if not attr:
            raise UserError(f"--factory must look like 'package.module:function', got {args.factory!r}")
        try:
            factory = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as e:
            raise UserError(f"--factory {args.factory!r}: {e}") from None
        try:
            built = factory()
        except Exception as e:  # a user's factory can fail in any way: report it in one line
            raise UserError(f"--factory {args.factory!r} raised {type(e).__name__}: {e}") from None
        if not (isinstance(built, tuple) and len(built) == 2 and isinstance(built[0], torch.nn.Module)):
            raise UserError("--factory must return (model, example_input) or (model, (inputs, ...))")
        model, inputs = built
        return model.to(dtype), (inputs if isinstance(inputs, tuple) else (inputs,))
    if args.hf:
        try:
            import transformers
        except ImportError:
            raise UserError("--hf needs transformers: pip install transformers (with -c constraints.txt)") from None
        config_name, model_name, kwargs = _HF_CONFIGS[args.hf]
        config = getattr(transformers, config_name)(**kwargs)
        model = getattr(transformers, model_name)(config).to(dtype)
        ids = torch.randint(0, config.vocab_size, (args.batch_size, args.seq_len))
        return model, (ids,)
    model = build_model(args.model, num_classes=10).to(dtype)
    x = torch.randn(args.batch_size, 3, args.image_size, args.image_size, dtype=dtype)
    return model, (x,)


def audit_command(args) -> int:
    from .audit import audit

    progress = _Progress(3, args.quiet)
    progress.step("building the model")
    model, inputs = _build_audit_target(args)
    progress.step(f"running stock and slimgrad forward+backward (case: {args.case})")
    try:
        report = audit(model, *inputs, case=args.case)
    except RuntimeError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"the model could not run on the example input: {first}") from None
    progress.step("done")
    print(report.table())
    if args.json:
        with open(args.json, "w") as f:
            f.write(report.to_json())
        print(f"JSON written to {args.json}")
    if args.plot:
        report.plot(args.plot)
        print(f"plot written to {args.plot}")
    return 0


def kernels_command(args) -> int:
    from . import kernels

    print(kernels.format_table())
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m slimgrad", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="convert an in-repo CNN and compare bytes kept for backward per case")
    p.add_argument("--model", default="resnet18", choices=sorted(MODELS))
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    p.set_defaults(run=demo)

    a = sub.add_parser("audit", help="per-module bytes kept for backward: stock vs minimum vs slimgrad")
    src = a.add_mutually_exclusive_group()
    src.add_argument("--model", default="resnet18", choices=sorted(MODELS), help="an in-repo CNN")
    src.add_argument("--hf", choices=sorted(_HF_CONFIGS), help="a small Hugging Face model built from a config")
    src.add_argument("--factory", help="'module:function' returning (model, example_input)")
    a.add_argument("--case", default="all", choices=AUDIT_CASES)
    a.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16", "float16"])
    a.add_argument("--batch-size", type=int, default=8)
    a.add_argument("--image-size", type=int, default=224)
    a.add_argument("--seq-len", type=int, default=128)
    a.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    a.add_argument("--plot", metavar="PATH", help="also draw a PNG bar chart (needs matplotlib)")
    a.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    a.set_defaults(run=audit_command)

    k = sub.add_parser("kernels", help="which kernel runs per op family, device and dtype (SLIMGRAD_KERNELS)")
    k.set_defaults(run=kernels_command, batch_size=1)

    args = parser.parse_args(argv)
    if args.batch_size < 1 or getattr(args, "image_size", 32) < 32:
        parser.error("--batch-size must be >= 1 and --image-size >= 32")
    try:
        return args.run(args)
    except UserError as e:
        print(f"slimgrad: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

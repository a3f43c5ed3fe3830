"""``python -m slimgrad ...``: the demo, the audit, the memory estimate and plan, and the kernel table.

Errors a user can cause (unknown model, bad shape, a factory that raises) end in one line on stderr and
exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import importlib
import json
import os
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
    kind = "encoder" if args.model.startswith("vit") else "CNN"
    print(f"slimgrad demo: {args.model}-like {kind}, input {tuple(x.shape)}, torch {torch.__version__}")
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
    # name: (config class, model class, config kwargs, pass labels=input_ids)
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                                                      num_attention_heads=4, num_key_value_heads=4,
                                                      vocab_size=4096), True),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_embd=256, n_layer=2, n_head=4, vocab_size=4096), True),
    "bert": ("BertConfig", "BertModel", dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                                             intermediate_size=1024, vocab_size=4096), False),
    "t5": ("T5Config", "T5ForConditionalGeneration", dict(d_model=256, d_ff=1024, num_layers=2, num_heads=4,
                                                          d_kv=64, vocab_size=4096, decoder_start_token_id=0), True),
}


def _factory_inputs(built) -> tuple:
    """(model, args, kwargs) from what a --factory returned: (model, x), (model, (x, ...)), (model, {name: x})
    or (model, (x, ...), {name: x})."""
    usage = ("--factory must return (model, input), (model, (inputs, ...)), (model, {'name': input}) or "
             "(model, (inputs, ...), {'name': input})")
    if not (isinstance(built, tuple) and len(built) in (2, 3) and isinstance(built[0], torch.nn.Module)):
        raise UserError(f"{usage}; got {type(built).__name__}")
    model, inputs, *rest = built
    if rest:
        if not isinstance(inputs, (tuple, list)) or not isinstance(rest[0], dict):
            raise UserError(usage)
        return model, tuple(inputs), dict(rest[0])
    if isinstance(inputs, dict):
        return model, (), dict(inputs)
    return model, (tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)), {}


def _cast(value, dtype):
    return value.to(dtype) if isinstance(value, torch.Tensor) and value.is_floating_point() else value


def _build_audit_target(args):
    """(model, args, kwargs) for the audit, from --model, --hf or --factory."""
    dtype = getattr(torch, args.dtype)
    if args.factory:
        module_name, _, attr = args.factory.partition(":")
        if not attr:
            raise UserError(f"--factory must look like 'package.module:function', got {args.factory!r}")
        try:
            factory = getattr(importlib.import_module(module_name), attr)
        except Exception as e:  # ImportError, AttributeError, or the module failing on import
            raise UserError(f"--factory {args.factory!r}: {type(e).__name__}: {e}") from None
        if not callable(factory):
            raise UserError(f"--factory {args.factory!r} is a {type(factory).__name__}, not a function")
        try:
            built = factory()
        except Exception as e:  # a user's factory can fail in any way: report it in one line
            raise UserError(f"--factory {args.factory!r} raised {type(e).__name__}: {e}") from None
        model, inputs, kwargs = _factory_inputs(built)
        if args.dtype != "float32":
            model = model.to(dtype)
            inputs = tuple(_cast(a, dtype) for a in inputs)
            kwargs = {k: _cast(v, dtype) for k, v in kwargs.items()}
        return model, inputs, kwargs
    if args.hf:
        try:
            import transformers
        except ImportError:
            raise UserError("--hf needs transformers: pip install 'slimgrad[hf]'") from None
        config_name, model_name, config_kwargs, labels = _HF_CONFIGS[args.hf]
        config = getattr(transformers, config_name)(**config_kwargs)
        model = getattr(transformers, model_name)(config).to(dtype)
        ids = torch.randint(0, config.vocab_size, (args.batch_size, args.seq_len))
        return model, (), {"input_ids": ids, **({"labels": ids} if labels else {})}
    model = build_model(args.model, num_classes=10).to(dtype)
    x = torch.randn(args.batch_size, 3, args.image_size, args.image_size, dtype=dtype)
    return model, (x,), {}


def _writable(option: str, path: str | None) -> None:
    """Fail before the (long) audit when an output file cannot be written."""
    if path is None:
        return
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise UserError(f"{option} {path!r}: directory {directory!r} does not exist")
    if os.path.isdir(path):
        raise UserError(f"{option} {path!r} is a directory; give a file name")
    if not os.access(directory, os.W_OK):
        raise UserError(f"{option} {path!r}: directory {directory!r} is not writable")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


@contextlib.contextmanager
def _user_errors(*prefixes: str):
    """slimgrad's own argument errors (already one line, without the function's prefix) and the user's model
    failing on the user's input, in any way, as one-line UserErrors."""
    try:
        yield
    except UserError:
        raise
    except (ValueError, TypeError, ImportError) as e:
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        for prefix in prefixes:
            message = message.removeprefix(prefix)
        raise UserError(message) from None
    except Exception as e:
        if os.environ.get("SLIMGRAD_TRACEBACK"):
            raise
        raise UserError(f"the model could not run on the example input: {_first_line(e)} "
                        f"(SLIMGRAD_TRACEBACK=1 shows the traceback)") from None


def _needs_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UserError("--plot needs matplotlib: pip install 'slimgrad[plot]'") from None


def audit_command(args) -> int:
    from .audit import audit

    _writable("--json", args.json)
    _writable("--plot", args.plot)
    if args.plot:
        _needs_matplotlib()
    progress = _Progress(3, args.quiet)
    progress.step("building the model")
    model, inputs, kwargs = _build_audit_target(args)
    progress.step(f"running stock and slimgrad forward+backward (case: {args.case})")
    with _user_errors("audit: "):
        report = audit(model, *inputs, case=args.case, **kwargs)
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


def _plan_dict(chosen) -> dict:
    return {"budget": chosen.budget, "device": chosen.device, "peak_before": chosen.peak_before,
            "peak_after": chosen.peak_after, "smallest_feasible": chosen.smallest_feasible, "fits": chosen.fits,
            "extra_seconds": chosen.extra_seconds, "actions": chosen.actions, "notes": list(chosen.notes),
            "blocks": [dataclasses.asdict(b) for b in chosen.blocks]}


def _side_by_side(estimates: dict) -> list[str]:
    """The totals of each estimate in one column each, so stock and converted compare at a glance."""
    rows = [("peak (everything alive)", "peak_bytes"), ("peak above the step's start", "step_peak_bytes"),
            ("weights", "weight_bytes"), ("inputs", "input_bytes"), ("gradients", "gradient_bytes"),
            ("optimizer state", "optimizer_bytes"), ("kept for backward", "kept_bytes")]
    names = list(estimates)
    lines = [f"{'MiB':<30}" + "".join(f"{n:>12}" for n in names)]
    for label, field in rows:
        lines.append(f"{label:<30}" + "".join(f"{getattr(estimates[n], field) / 2**20:12.2f}" for n in names))
    return lines


def estimate_command(args) -> int:
    """Simulate one training step (forward, loss, backward, optimizer step) on fake tensors: no activation is
    allocated, so a model that would not fit can be sized here. Exit code 1 when --budget cannot be met."""
    from .estimate import estimate, parse_bytes
    from .plan import plan

    _writable("--json", args.json)
    _writable("--plot", args.plot)
    budget = None
    if args.budget is not None:
        try:
            budget = parse_bytes(args.budget, "--budget")
        except (TypeError, ValueError) as e:
            raise UserError(str(e)) from None
    if args.plot:
        if budget is None:
            raise UserError("--plot draws the memory plan: give --budget too (e.g. --budget 12GiB)")
        _needs_matplotlib()
    which = ["stock", "slimgrad"] if args.which is None else [args.which]
    progress = _Progress(2 + len(which) + (budget is not None), args.quiet)
    progress.step("building the model")
    model, inputs, kwargs = _build_audit_target(args)
    if budget is not None and inputs and kwargs:
        raise UserError("--budget plans for one batch: a dict of keyword inputs, or positional inputs; the "
                        "--factory returned both")
    model.train()  # a training step: dropout draws, batch norms use the batch
    optimizer = None if args.optimizer == "none" else args.optimizer
    models = {"stock": model} if "stock" in which else {}
    estimates = {}
    with _user_errors("estimate: ", "plan: "):
        if "slimgrad" in which:
            # a converted deep copy: the stock model stays as built
            models["slimgrad"] = convert(model, chunked_loss=args.chunked_loss)
        for name in which:
            progress.step(f"simulating one training step of the {name} model on fake tensors")
            estimates[name] = estimate(models[name], *inputs, optimizer=optimizer, **kwargs)
        chosen = None
        if budget is not None:
            name = which[-1]
            progress.step(f"planning the {name} model for a budget of {args.budget}")
            chosen = plan(models[name], budget, kwargs if kwargs else inputs, optimizer=optimizer)
    progress.step("done")
    opt = f", optimizer {optimizer}" if optimizer else ", no optimizer"
    print(f"one training step (forward, loss, backward{', optimizer step' if optimizer else ''}){opt}, "
          f"simulated on fake tensors:")
    for line in _side_by_side(estimates):
        print(line)
    for name in which:
        print(f"\n{'stock PyTorch' if name == 'stock' else 'slimgrad.convert'}:")
        print(estimates[name])
    if chosen is not None:
        print(f"\nmemory plan for the {'stock' if which[-1] == 'stock' else 'converted'} model:")
        print(chosen)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**{n: e.as_dict() for n, e in estimates.items()},
                       **({"plan": _plan_dict(chosen)} if chosen is not None else {})}, f, indent=1)
        print(f"JSON written to {args.json}")
    if args.plot:
        chosen.plot(args.plot)
        print(f"plot written to {args.plot}")
    return 0 if chosen is None or chosen.fits else 1


def _cuda_kernels_words(status: dict) -> str:
    has, why = status.get("cuda_kernels"), status.get("cuda_kernels_reason")
    if has:
        return "built in"
    if has is None:
        return why or "not built yet"
    if not status["enabled"] or not status.get("cuda", True) or torch.version.cuda is None:
        return f"none ({why})"
    return f"none ({why}); CUDA ReLUs run its aten route (same bits, more launches)"


def _core_lines(status: dict) -> list[str]:
    state = ("loaded" if status["loaded"] else "built (cached), not loaded in this process" if status["cached"]
             else "not built yet (built on first use, or `python -m slimgrad build`)")
    lines = [f"compiled core: {'enabled' if status['enabled'] else 'disabled (SLIMGRAD_CORE=0)'}; {state}",
             "  CUDA tensors: " + ("conv, average pooling, LoRA linear without dropout, batch norm (cuDNN where "
                                   "stock runs it), ReLU / LeakyReLU up to 4M elements (the other families: CPU "
                                   "only)" if status.get("cuda", True)
                                   else "none (SLIMGRAD_CORE_CUDA=0)"),
             "  its own CUDA kernels (ReLU / LeakyReLU masks, one launch each way): " + _cuda_kernels_words(status),
             f"  cache: {status['cache']}",
             f"  sources: {', '.join(status['sources'])}"]
    if status["reason"]:
        lines.append(f"  unavailable: {status['reason']}; the Python path runs (same numbers and bytes, more "
                     f"time per call)")
    return lines


def kernels_command(args) -> int:
    from . import csrc, kernels

    for line in _core_lines(csrc.status()):
        print(line)
    print(kernels.format_table())  # (describes: never builds the core, which `build` does)
    return 0


def build_command(args) -> int:
    """Build the compiled core ahead of time (CI, Docker images, before launching DDP ranks)."""
    from . import csrc

    try:
        module = csrc.build(verbose=args.verbose, force=args.force)
    except Exception as e:  # noqa: BLE001 - a failed build is reported in one line, the Python path still runs
        # (no compiler found: there is no compiler output to show)
        hint = ("" if csrc._why_no_compiler() is not None
                else " `python -m slimgrad build --verbose` shows the compiler's output.")
        print(f"slimgrad: error: the compiled core did not build: {_first_line(e)}\n"
              f"slimgrad still works without it (the Python path runs).{hint}", file=sys.stderr)
        return 1
    print(f"slimgrad: compiled core ready: {module.__file__}")
    if csrc._cuda_torch() is not None:  # (a CUDA build of torch: say whether its own CUDA kernels are in it)
        print(f"slimgrad: its own CUDA kernels: {_cuda_kernels_words(csrc.status())}")
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad command line ends in one line on stderr (exit code 2), like every other error."""

    def error(self, message):
        self.exit(2, f"slimgrad: error: {message} (see {self.prog} --help)\n")


def main(argv=None) -> int:
    parser = _Parser(prog="python -m slimgrad", description=__doc__)
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
    src.add_argument("--factory", help="'module:function' returning (model, input), (model, (inputs, ...)), "
                                       "(model, {'name': input}) or (model, (inputs, ...), {'name': input})")
    a.add_argument("--case", default="all", choices=AUDIT_CASES)
    a.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16", "float16"])
    a.add_argument("--batch-size", type=int, default=8)
    a.add_argument("--image-size", type=int, default=224)
    a.add_argument("--seq-len", type=int, default=128)
    a.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    a.add_argument("--plot", metavar="PATH", help="also draw a PNG bar chart (needs matplotlib)")
    a.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    a.set_defaults(run=audit_command)

    e = sub.add_parser("estimate", help="memory of one training step before running it (stock and slimgrad), "
                                        "and a plan that fits a budget")
    src = e.add_mutually_exclusive_group()
    src.add_argument("--model", default="resnet18", choices=sorted(MODELS), help="an in-repo CNN")
    src.add_argument("--hf", choices=sorted(_HF_CONFIGS), help="a small Hugging Face model built from a config")
    src.add_argument("--factory", help="'module:function' returning (model, input), (model, (inputs, ...)), "
                                       "(model, {'name': input}) or (model, (inputs, ...), {'name': input})")
    e.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16", "float16"])
    e.add_argument("--batch-size", type=int, default=8)
    e.add_argument("--image-size", type=int, default=224)
    e.add_argument("--seq-len", type=int, default=128)
    e.add_argument("--optimizer", default="none", choices=["none", "adamw", "sgd"],
                   help="include the optimizer's state and step (default: forward and backward only)")
    which = e.add_mutually_exclusive_group()
    which.add_argument("--convert", dest="which", action="store_const", const="slimgrad",
                       help="only the model converted by slimgrad (default: stock and converted side by side)")
    which.add_argument("--stock", dest="which", action="store_const", const="stock",
                       help="only the stock model")
    e.add_argument("--chunked-loss", action="store_true",
                   help="convert with chunked_loss=True (the loss computed in chunks, no full logits)")
    e.add_argument("--budget", metavar="BYTES", help="e.g. 12GiB, 800MB: also plan the converted model (the stock "
                                                     "one with --stock) for this budget; exit code 1 if no plan "
                                                     "meets it")
    e.add_argument("--json", metavar="PATH", help="also write the estimates (and plan) as JSON")
    e.add_argument("--plot", metavar="PATH", help="also draw the plan as a PNG (needs --budget and matplotlib)")
    e.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    e.set_defaults(run=estimate_command, which=None)

    k = sub.add_parser("kernels", help="which kernel runs per op family, device and dtype (SLIMGRAD_KERNELS)")
    k.set_defaults(run=kernels_command, batch_size=1)

    b = sub.add_parser("build", help="build slimgrad's compiled core now (otherwise built on first use)")
    b.add_argument("--force", action="store_true", help="rebuild even if a cached build exists")
    b.add_argument("--verbose", action="store_true", help="show the compiler's commands and output")
    b.set_defaults(run=build_command, batch_size=1)

    args = parser.parse_args(argv)
    if args.batch_size < 1 or getattr(args, "image_size", 32) < 32 or getattr(args, "seq_len", 1) < 1:
        parser.error("--batch-size and --seq-len must be >= 1 and --image-size >= 32")
    in_repo_cnn = args.command == "demo" or (args.command in ("audit", "estimate") and not getattr(args, "hf", None)
                                             and not getattr(args, "factory", None)
                                             and getattr(args, "case", None) != "input-bn-eval")
    if in_repo_cnn and args.batch_size < 2:
        parser.error("--batch-size must be >= 2 for the in-repo CNNs: their batch norms train, and batch norm "
                     "in training mode needs more than one value per channel")
    try:
        code = args.run(args)
        sys.stdout.flush()  # (inside the try: a reader gone shows here, not as an "Exception ignored" at exit)
        return code
    except UserError as e:
        print(f"slimgrad: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `python -m slimgrad kernels | head`: the reader left; no traceback (Python's recipe)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())

"""``python -m slimgrad ...``: the demo (and, as they land, the audit)."""

from __future__ import annotations

import argparse
import copy
import sys

import torch

from . import convert
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m slimgrad", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="convert an in-repo CNN and compare bytes kept for backward per case")
    p.add_argument("--model", default="resnet18", choices=sorted(MODELS))
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    p.set_defaults(run=demo)
    args = parser.parse_args(argv)
    if args.batch_size < 1 or args.image_size < 32:
        parser.error("--batch-size must be >= 1 and --image-size >= 32")
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())

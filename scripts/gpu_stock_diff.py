"""Where converted BatchNorm / MaxPool / AvgPool modules differ from stock on CUDA, and by how much.

    python scripts/gpu_stock_diff.py                 # CUDA (prints "no CUDA" and exits 0 without it)
    python scripts/gpu_stock_diff.py --device cpu    # the same cases on CPU: every one must be bitwise

For every case a stock module and its converted twin (``slimgrad.convert``, an independent copy) run on the same
input, and so does a second stock copy (a stock run that differs from itself marks a nondeterministic stock kernel,
e.g. atomics). Compared: the output (and returned indices), the running statistics, and every requested gradient,
taken with ``torch.autograd.grad`` so that its layout is the one the backward produced (AccumulateGrad would
restride it). One line per case, then counts per class (module, stock's kernel, layout, dtype):

* ``bitwise``: every compared tensor has stock's bits and strides;
* ``rounding``: finite values within BOUND units of the dtype's eps relative to the tensor's largest stock value
  (the worst such ratio is printed: "N.Neps"), same NaN/inf positions, same strides;
* ``WRONG``: anything else (shape, dtype, strides, NaN/inf placement, integer indices, a diff beyond BOUND, one
  side raising).

Why BOUND = 32 eps of the largest value: two correct kernels for the same op differ by how they associate fp32
sums (batch statistics over a few hundred elements here, overlapping pooling windows) and how they fuse the affine
step (cuDNN's inference y = x * scale + shift against aten's (x - mean) * invstd * w + b), then round once to the
dtype. That is a few eps; batch norm's training input gradient subtracts two such sums, so a value can lose a few
more bits to cancellation. A wrong gradient (a missing term, a wrong window, a stale statistic) is off by O(1) of
the scale, far beyond 32 eps for every dtype used here (fp16's 32 eps is 3 %, bf16's 25 %: the 16-bit cases are
also checked against the fp32 cases' verdicts by the class counts, not by this bound alone).

Exit status 1 only when some case is WRONG. Shapes are small so that the whole run takes seconds on a GPU.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import sys
import time
from collections import Counter, defaultdict

import torch
from torch import nn

import slimgrad

BOUND = 32.0
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# ------------------------------------------------------------------------------------------------ comparing


def _bits(t: torch.Tensor) -> torch.Tensor:
    view = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[t.element_size()]
    return t.contiguous().view(view) if t.is_floating_point() else t.contiguous()


def _strides(t: torch.Tensor):
    """Strides of the dims with more than one element (others do not change the layout)."""
    return tuple(st for sz, st in zip(t.shape, t.stride()) if sz > 1)


def compare(a, b):
    """(verdict, eps_units or None, note) for slimgrad's ``a`` against stock's ``b``."""
    if a is None or b is None:
        return ("bitwise", 0.0, "") if a is None and b is None else ("WRONG", None, "missing")
    if a.shape != b.shape or a.dtype != b.dtype:
        return "WRONG", None, f"shape/dtype {tuple(a.shape)}/{a.dtype} vs {tuple(b.shape)}/{b.dtype}"
    layout = "" if _strides(a) == _strides(b) else f"strides {a.stride()} vs {b.stride()}"
    if torch.equal(_bits(a), _bits(b)):
        return ("WRONG", 0.0, layout) if layout else ("bitwise", 0.0, "")
    if not a.is_floating_point():
        return "WRONG", None, "integer values differ"
    af, bf = a.double(), b.double()
    fa, fb = torch.isfinite(af), torch.isfinite(bf)
    if not torch.equal(fa, fb) or not torch.equal(af[~fa].nan_to_num(), bf[~fb].nan_to_num()):
        return "WRONG", None, "NaN/inf placement"
    diff = (af[fa] - bf[fb]).abs().max().item()
    scale = bf[fb].abs().max().item()
    units = diff / (torch.finfo(a.dtype).eps * max(scale, torch.finfo(a.dtype).tiny))
    note = f"max|d|={diff:.3g}"
    if layout:
        return "WRONG", units, note + " " + layout
    return ("rounding" if units <= BOUND else "WRONG"), units, note


RANK = {"bitwise": 0, "rounding": 1, "WRONG": 2}


def run_side(module, x, wanted, grad_fn):
    """Forward, then the gradients of ``wanted`` (a name -> tensor dict) with torch.autograd.grad."""
    result = module(x)
    out = result[0] if isinstance(result, tuple) else result
    tensors = {"out": out}
    if isinstance(result, tuple):
        tensors["indices"] = result[1]
    if wanted:
        grads = torch.autograd.grad(out, list(wanted.values()), grad_fn(out))
        tensors.update({f"d{name}": g for name, g in zip(wanted, grads)})
    for name, buf in module.named_buffers():
        tensors[name] = buf.detach().clone()
    return tensors


def judge(slim_t, stock_t, stock2_t):
    """The case's verdict and its printable details."""
    worst, details, nondet = "bitwise", [], []
    for name in stock_t:
        verdict, units, note = compare(slim_t.get(name), stock_t[name])
        if verdict != "bitwise":
            details.append(f"{name}:{verdict}" + (f"({units:.1f}eps" if units is not None else "(")
                           + (f" {note})" if note else ")"))
        if compare(stock2_t[name], stock_t[name])[0] != "bitwise":
            nondet.append(name)
        if RANK[verdict] > RANK[worst]:
            worst = verdict
    return worst, details, nondet


# ---------------------------------------------------------------------------------------------------- cases


def make_input(shape, dtype, fmt, device, seed, ties=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-3, 4, shape, generator=g).float() if ties else torch.randn(shape, generator=g)
    x = x.to(device=device, dtype=dtype)
    if fmt == "cl":
        x = x.contiguous(memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d)
    return x


def grad_fn_for(kind, seed):
    def make(out):
        g = torch.Generator().manual_seed(seed + 1)
        if kind == "expanded":  # e.g. out.sum().backward(): a zero-stride dY
            return torch.randn((), generator=g).to(out.device, out.dtype).expand(out.shape)
        return torch.randn(out.shape, generator=g).to(out.device, out.dtype).contiguous(
            memory_format=_format_of(out))
    return make


def _format_of(t):
    if t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    if t.dim() == 5 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last_3d):
        return torch.channels_last_3d
    return torch.contiguous_format


BN_SHAPES = {"BatchNorm1d(N,C)": (nn.BatchNorm1d, (8, 6)), "BatchNorm1d(N,C,L)": (nn.BatchNorm1d, (4, 6, 7)),
             "BatchNorm2d": (nn.BatchNorm2d, (4, 6, 5, 5)), "BatchNorm3d": (nn.BatchNorm3d, (2, 6, 3, 4, 5))}


def _stock_bn_backend(module, x, training):
    """Which kernel stock's ``torch.batch_norm`` picks here (aten's own selector)."""
    if module.weight is None or x.device.type != "cuda":
        return "native"
    training = training or module.running_mean is None
    stat = module.running_mean if module.running_mean is not None else module.weight  # only .defined() is read
    var = module.running_var if module.running_var is not None else module.weight
    backend = torch._C._select_batch_norm_backend(x, module.weight, module.bias, stat, var, training, module.eps)
    return str(backend).rsplit(".", 1)[-1].lower()


def bn_cases(device):
    seed = 0
    for (name, (cls, shape)), train, track, affine, dt, mixed, fmt, dy in itertools.product(
            BN_SHAPES.items(), (True, False), (True, False), (True, False), DTYPES, (False, True), ("contig", "cl"),
            ("dense", "expanded")):
        if (fmt == "cl" and len(shape) < 4) or (mixed and dt == "fp32") or (dy == "expanded" and dt != "fp32"):
            continue
        if not train and not track:  # eval without running statistics is training's batch-statistics call
            continue
        combos = itertools.product((True, False), repeat=3) if affine else ((x, False, False) for x in (True, False))
        for x_rg, w_rg, b_rg in combos:
            seed += 1
            yield dict(family="bn", name=name, cls=cls, shape=shape, train=train, track=track, affine=affine,
                       dtype=dt, mixed=mixed, fmt=fmt, dy=dy, x_rg=x_rg, w_rg=w_rg, b_rg=b_rg, seed=seed)


POOL_SHAPES = {1: (2, 3, 11), 2: (2, 3, 9, 10), 3: (2, 3, 7, 8, 9)}
MAX_GEOMETRY = [dict(kernel_size=3, stride=2, padding=1), dict(kernel_size=2, stride=2, padding=0),
                dict(kernel_size=3, stride=1, padding=1, dilation=2)]
AVG_GEOMETRY = [dict(kernel_size=3, stride=2, padding=1), dict(kernel_size=2, stride=2, padding=0),
                dict(kernel_size=3, stride=1, padding=1)]


def pool_cases(device):
    seed = 100000
    for nd, geo, ceil, ret, dt, fmt, ties, x_rg in itertools.product(
            (1, 2, 3), MAX_GEOMETRY, (False, True), (False, True), DTYPES, ("contig", "cl"), (False, True),
            (True, False)):
        if (fmt == "cl" and nd == 1) or (not x_rg and (dt != "fp32" or ties)):
            continue
        if dt != "fp32" and geo is not MAX_GEOMETRY[0]:
            # Every geometry and dtype is a Triton compile on CUDA (contiguous 1-d/2-d): the 16-bit dtypes get the
            # overlapping one only, so that a cold cache still fits the time budget.
            continue
        seed += 1
        yield dict(family="max", name=f"MaxPool{nd}d", cls=getattr(nn, f"MaxPool{nd}d"), nd=nd,
                   kwargs=dict(geo, ceil_mode=ceil, return_indices=ret), dtype=dt, fmt=fmt, ties=ties, x_rg=x_rg,
                   seed=seed)
    for nd, geo, ceil, cip, div, dt, fmt, x_rg in itertools.product(
            (1, 2, 3), AVG_GEOMETRY, (False, True), (True, False), (None, 5), DTYPES, ("contig", "cl"),
            (True, False)):
        if (fmt == "cl" and nd == 1) or (div is not None and nd == 1) or (not x_rg and dt != "fp32"):
            continue
        seed += 1
        kwargs = dict(geo, ceil_mode=ceil, count_include_pad=cip)
        if nd > 1:
            kwargs["divisor_override"] = div
        yield dict(family="avg", name=f"AvgPool{nd}d", cls=getattr(nn, f"AvgPool{nd}d"), nd=nd, kwargs=kwargs,
                   dtype=dt, fmt=fmt, ties=False, x_rg=x_rg, seed=seed)


def build_bn(case, device):
    torch.manual_seed(case["seed"])
    m = case["cls"](case["shape"][1], affine=case["affine"], track_running_stats=case["track"])
    with torch.no_grad():
        if case["affine"]:
            m.weight.uniform_(0.5, 1.5)
            m.bias.uniform_(-0.5, 0.5)
        if case["track"]:
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
    m = m.to(device)
    if not case["mixed"]:
        m = m.to(DTYPES[case["dtype"]])
    m.train(case["train"])
    return m


def run_case(case, device):
    """(class key, verdict, line)."""
    dtype = DTYPES[case["dtype"]]
    if case["family"] == "bn":
        base = build_bn(case, device)
        shape = case["shape"]
        desc = (f"{case['name']} {'train' if case['train'] else 'eval'} track={int(case['track'])} "
                f"affine={int(case['affine'])} {case['dtype']}{'(fp32 params)' if case['mixed'] else ''} "
                f"{case['fmt']} dy={case['dy']} grad[x,w,b]={int(case['x_rg'])}{int(case['w_rg'])}"
                f"{int(case['b_rg'])}")
    else:
        base = case["cls"](**case["kwargs"])
        shape = POOL_SHAPES[case["nd"]]
        desc = (f"{case['name']} {case['kwargs']} {case['dtype']} {case['fmt']}{' ties' if case['ties'] else ''} "
                f"grad[x]={int(case['x_rg'])}")
    x = make_input(shape, dtype, case["fmt"], device, case["seed"], case.get("ties", False))
    stock, stock2, slim = base, copy.deepcopy(base), slimgrad.convert(copy.deepcopy(base))
    if case["family"] == "bn":
        backend = _stock_bn_backend(stock, x, case["train"])
        key = (f"{case['name']} {'train' if case['train'] or not case['track'] else 'eval'} stock={backend} "
               f"{case['fmt']} {case['dtype']}{'+fp32' if case['mixed'] else ''}")
    else:
        key = f"{case['name']} {case['fmt']} {case['dtype']}"
    results = []
    for module in (slim, stock, stock2):
        xi = x.detach().clone().requires_grad_(case["x_rg"])
        wanted = {"x": xi} if case["x_rg"] else {}
        if case["family"] == "bn" and case["affine"]:
            module.weight.requires_grad_(case["w_rg"])
            module.bias.requires_grad_(case["b_rg"])
            if case["w_rg"]:
                wanted["w"] = module.weight
            if case["b_rg"]:
                wanted["b"] = module.bias
        try:
            results.append(run_side(module, xi, wanted, grad_fn_for(case.get("dy", "dense"), case["seed"])))
        except Exception as exc:  # noqa: BLE001 - compared below: both sides must raise alike
            results.append(exc)
    slim_t, stock_t, stock2_t = results
    if isinstance(stock_t, Exception) or isinstance(slim_t, Exception):
        same = type(slim_t) is type(stock_t)
        return key, ("bitwise" if same else "WRONG"), f"{desc}: raises {type(slim_t).__name__}/{type(stock_t).__name__}"
    verdict, details, nondet = judge(slim_t, stock_t, stock2_t)
    line = f"{desc}: {verdict}"
    if details:
        line += " " + " ".join(details)
    if nondet:
        line += f" [stock differs from itself: {','.join(nondet)}]"
    return key, verdict, line


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--only", default="bn,max,avg", help="comma-separated families: bn, max, avg")
    parser.add_argument("--quiet", action="store_true", help="print only cases that are not bitwise")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA: nothing to compare (run with --device cpu for the CPU check)")
        return 0
    device = torch.device(args.device)
    families = set(args.only.split(","))
    if args.device == "cuda":
        print(f"{torch.cuda.get_device_name()} torch {torch.__version__} cuDNN {torch.backends.cudnn.version()}")
    start = time.perf_counter()
    counts: dict = defaultdict(Counter)
    nondet_classes: Counter = Counter()
    cases = [c for c in itertools.chain(bn_cases(device), pool_cases(device)) if c["family"] in families]
    family_time: Counter = Counter()
    for case in cases:
        t0 = time.perf_counter()
        key, verdict, line = run_case(case, device)
        family_time[case["family"]] += time.perf_counter() - t0
        counts[key][verdict] += 1
        if "stock differs from itself" in line:
            nondet_classes[key] += 1
        if not args.quiet or verdict != "bitwise":
            print(f"{verdict:8s} {line}")
    print(f"\n{len(cases)} cases in {time.perf_counter() - start:.1f} s on {args.device}; per class "
          "(bitwise / rounding / WRONG; stock nondeterministic in):")
    total = Counter()
    for key in sorted(counts):
        c = counts[key]
        total.update(c)
        print(f"  {key:55s} {c['bitwise']:4d} {c['rounding']:4d} {c['WRONG']:4d}"
              + (f"  (stock nondeterministic in {nondet_classes[key]})" if nondet_classes[key] else ""))
    print("seconds per family: " + ", ".join(f"{k} {v:.1f}" for k, v in family_time.items()))
    print(f"total: {total['bitwise']} bitwise, {total['rounding']} within rounding, {total['WRONG']} WRONG")
    return 1 if total["WRONG"] else 0


if __name__ == "__main__":
    sys.exit(main())

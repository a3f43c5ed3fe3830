"""``torch.compile(fullgraph=True)`` over the eager tests' option matrices: every family, every constructor
option, int and tuple arguments, and the requires_grad cases that make a Function take different paths.

Compiling is 10-25 s per graph on a 2-core CPU, so each family is one graph: a module holding every case as
a branch, each branch with its own input and its own requires_grad flags. The backend is ``aot_eager``:
dynamo with ``fullgraph=True`` (no graph break anywhere) and AOTAutograd's joint trace of every Function's
forward and backward, which is where compile problems of autograd Functions show; the traced graph then runs
the same aten ops eagerly, so values are compared with stock eager as the eager tests compare them. Inductor
(the default backend) lowers each graph to its own kernels and costs minutes for a graph this size
(measured: 218 s for the pooling matrix vs 20 s with aot_eager); ``tests/test_compile_bytes.py`` runs it on
one representative graph per family, with values and bytes kept.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from tests._util import assert_same
from torch import nn

import slimgrad

pytestmark = pytest.mark.slow



class Branches(nn.Module):
    """Every case of a family side by side: ``forward(inputs)`` returns one output per branch."""

    def __init__(self, modules, calls=None):
        super().__init__()
        self.branches = nn.ModuleList(modules)
        self.calls = calls or [None] * len(modules)

    def forward(self, inputs):
        outs = []
        for module, call, x in zip(self.branches, self.calls, inputs):
            out = module(x) if call is None else call(module, x)
            outs.append(out[0] if isinstance(out, tuple) else out)
        return outs


def run_family(stock, inputs, backend="aot_eager", *, exact=True, grad_seed=0, check=None, param_tol=None,
               prepare=None, dynamic=False):
    """Compile a converted copy of ``stock`` (a :class:`Branches`) with ``fullgraph=True`` and compare one
    training step's outputs, input gradients and parameter gradients with stock eager on independent copies.

    ``inputs``: one tensor per branch; its ``requires_grad`` is the branch's input flag. ``check``: a
    replacement comparison ``check(out_stock, out_compiled, grad_stock, grad_compiled)`` for random families.
    ``dynamic``: passed to torch.compile (True makes shapes and float arguments symbolic).
    """
    torch._dynamo.reset()
    slim = slimgrad.convert(copy.deepcopy(stock))
    if prepare is not None:
        prepare(slim)
    compiled = torch.compile(slim, fullgraph=True, backend=backend, dynamic=dynamic)
    xs = [x.detach().clone().requires_grad_(x.requires_grad) for x in inputs]
    xc = [x.detach().clone().requires_grad_(x.requires_grad) for x in inputs]
    out_s, out_c = stock(xs), compiled(xc)
    gen = torch.Generator().manual_seed(grad_seed)
    loss_s = loss_c = 0
    for a, b in zip(out_s, out_c):
        g = torch.randn(a.shape, generator=gen).to(a.dtype)
        if a.requires_grad:
            loss_s = loss_s + (a * g).sum()
            loss_c = loss_c + (b * g).sum()
    loss_s.backward()
    loss_c.backward()
    tol = {} if exact else dict(exact=False, rtol=2e-5, atol=2e-5)
    for i, (a, b, x1, x2) in enumerate(zip(out_s, out_c, xs, xc)):
        if check is not None:
            check(a, b, x2, x2.grad)
            continue
        assert_same(b, a, what=f"branch {i} output", **tol)
        assert b.requires_grad == a.requires_grad, f"branch {i}"
        assert_same(x2.grad, x1.grad, what=f"branch {i} input grad", **tol)
    for (name, p), q in zip(stock.named_parameters(), slim.parameters()):
        if check is None:
            assert_same(q.grad, p.grad, what=f"{name} grad", **(tol if param_tol is None else param_tol))
        else:
            assert (q.grad is None) == (p.grad is None), name
    for (name, b), c in zip(stock.named_buffers(), slim.buffers()):
        assert_same(c, b, what=name, **tol)
    return slim


def _combos(n, options):
    """Every (option, requires_grad combination) pair."""
    return list(itertools.product(range(len(options)), range(n)))


def _set_flags(module, rg_params):
    for name, p in module.named_parameters():
        p.requires_grad_(rg_params.get(name.rsplit(".", 1)[-1], False))


# ------------------------------------------------------------------------------------------------ pooling


def test_pooling():
    """Every max/avg/adaptive-avg case of tests/test_pooling.py (int, tuple and None output sizes, ceil_mode,
    dilation, return_indices, divisor_override, unbatched), contiguous and channels_last."""
    from tests.test_pooling import AVG_CASES, CL, MAX_CASES

    cases = MAX_CASES + AVG_CASES
    modules, inputs = [], []
    for i, layout in _combos(2, cases):
        module, shape = cases[i]
        x = torch.randn(shape)
        if layout and x.dim() in CL:
            x = x.contiguous(memory_format=CL[x.dim()])
        modules.append(copy.deepcopy(module))
        inputs.append(x.requires_grad_())
    run_family(Branches(modules), inputs)


# ---------------------------------------------------------------------------------------------------- conv


def test_conv():
    """Every case of tests/test_conv.py (1-3d, transposed with output_size, every padding mode, 'same' and
    'valid', groups, depthwise, dilation, unbatched) under every (input, weight, bias) requires_grad case that
    changes what is kept. Bias gradients with a frozen weight differ from stock by rounding (documented)."""
    from tests.test_conv import CASES

    flags = [(True, False, False), (True, True, True), (False, True, False), (True, False, True), (False, False, True)]
    modules, inputs, calls = [], [], []
    for i, j in _combos(len(flags), CASES):
        _, cls, kwargs, shape, fk = CASES[i]
        rx, rw, rb = flags[j]
        torch.manual_seed(i)
        module = cls(**kwargs)
        _set_flags(module, {"weight": rw, "bias": rb})
        modules.append(module)
        calls.append((lambda m, x, fk=fk: m(x, **fk)) if fk else None)
        inputs.append(torch.randn(shape).requires_grad_(rx))
    run_family(Branches(modules, calls), inputs, param_tol=dict(exact=False, rtol=1e-4, atol=1e-5))


# ---------------------------------------------------------------------------------------------- batch norm


def test_batch_norm():
    """Every shape and option of tests/test_batch_norm.py (affine=False, momentum, untracked, eps), train and
    eval, each (input, weight, bias) requires_grad combination spread over them; running stats compared."""
    from tests.test_batch_norm import OPTIONS, SHAPES

    # momentum=None (cumulative average, 1 / num_batches_tracked) is data-dependent: stock's fullgraph
    # compile fails on it as well ("Could not guard on data-dependent expression"), so it is left out.
    cases = [(cls, shape, opts, train) for cls, shape in SHAPES.values() for opts in OPTIONS.values()
             for train in (True, False) if not (train and opts.get("momentum", 0.1) is None)]
    flags = list(itertools.product([False, True], repeat=3))[1:]
    modules, inputs = [], []
    for i, (cls, shape, opts, train) in enumerate(cases):
        rx, rw, rb = flags[i % len(flags)]
        torch.manual_seed(i)
        module = cls(shape[1], **opts).train(train)
        if module.affine:
            with torch.no_grad():
                module.weight.uniform_(0.5, 1.5)
                module.bias.uniform_(-0.5, 0.5)
        elif not rx:
            rx = True
        _set_flags(module, {"weight": rw, "bias": rb})
        modules.append(module)
        inputs.append(torch.randn(shape).requires_grad_(rx))
    run_family(Branches(modules), inputs, exact=False)


# --------------------------------------------------------------------------------------------------- norms


def test_norms():
    """RMSNorm, LayerNorm and GroupNorm options of tests/test_norms.py (2-d normalized_shape, no affine, no
    bias, channels_last GroupNorm), the Hugging Face RMSNorm casting styles (functional), FusedAddRMSNorm and
    PolyNorm, each under several (input, weight, bias) requires_grad cases."""
    from tests.test_norms import LN_OPTIONS, RMS_OPTIONS

    from slimgrad.nn.norms import FusedAddRMSNorm, PolyNorm

    flags = [(True, False, False), (True, True, True), (False, True, False), (False, False, True)]
    makers = [(lambda o=o: nn.RMSNorm(**o), (2, 3, 3, 8) if isinstance(o["normalized_shape"], tuple) else (2, 3, 8))
              for o in RMS_OPTIONS.values()]
    makers += [(lambda o=o: nn.LayerNorm(**o), (2, 3, 3, 8) if isinstance(o["normalized_shape"], tuple) else (2, 3, 8))
               for o in LN_OPTIONS.values()]
    makers += [(lambda: nn.GroupNorm(2, 4), (2, 4, 3, 3)), (lambda: nn.GroupNorm(4, 4, affine=False), (2, 4, 5)),
               (lambda: nn.GroupNorm(1, 4), "channels_last")]
    modules, inputs = [], []
    for i, j in _combos(len(flags), makers):
        make, shape = makers[i]
        rx, rw, rb = flags[j]
        module = make()
        with torch.no_grad():
            for p in module.parameters():
                p.uniform_(-1.5, 1.5)
        if not any(True for _ in module.parameters()) or shape == "channels_last":
            rx = True  # channels_last: stock's GroupNorm backward segfaults without dX (torch 2.13, documented)
        _set_flags(module, {"weight": rw, "bias": rb})
        x = torch.randn((2, 4, 3, 5) if shape == "channels_last" else shape)
        if shape == "channels_last":
            x = x.contiguous(memory_format=torch.channels_last)
        modules.append(module)
        inputs.append(x.requires_grad_(rx or not (rw or rb)))
    run_family(Branches(modules), inputs)

    # Hugging Face casting styles, FusedAddRMSNorm and PolyNorm (no stock module: compiled vs eager slimgrad).
    from slimgrad.functional.norms import rms_norm_hf

    class Styles(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.rand(8) + 0.5)
            self.fused = FusedAddRMSNorm(8)
            self.poly = PolyNorm()

        def forward(self, inputs):
            x = inputs[0]
            # a copy each: eager hands x the square's and the product's gradients apart, as stock's formula does,
            # compiled their sum (dynamo refuses one tensor passed twice), which differs only where x has other
            # readers whose gradients come in between
            outs = [rms_norm_hf(x.clone(), self.weight, 1e-6, style) for style in ("llama", "olmo2", "gemma", "t5")]
            outs += list(self.fused(x, inputs[1]))
            outs.append(self.poly(inputs[1]))
            return outs

    _compare_with_eager_slim(Styles(), [torch.randn(2, 3, 8, dtype=torch.bfloat16).float().requires_grad_(),
                                        torch.randn(2, 3, 8).requires_grad_()])


def _compare_with_eager_slim(module, inputs, dynamic=False):
    """For modules with no stock counterpart: compiled vs eager, both slimgrad, same aten ops (bitwise)."""
    torch._dynamo.reset()
    eager, other = module, copy.deepcopy(module)
    compiled = torch.compile(other, fullgraph=True, backend="aot_eager", dynamic=dynamic)
    xe = [x.detach().clone().requires_grad_(x.requires_grad) for x in inputs]
    xc = [x.detach().clone().requires_grad_(x.requires_grad) for x in inputs]
    out_e, out_c = eager(xe), compiled(xc)
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(o.shape, generator=gen) for o in out_e]
    sum((o * g).sum() for o, g in zip(out_e, grads)).backward()
    sum((o * g).sum() for o, g in zip(out_c, grads)).backward()
    for i, (a, b) in enumerate(zip(out_e, out_c)):
        assert_same(b, a, what=f"output {i}")
    for i, (a, b) in enumerate(zip(xe, xc)):
        assert_same(b.grad, a.grad, what=f"input {i} grad")
    for (name, p), q in zip(eager.named_parameters(), other.parameters()):
        assert_same(q.grad, p.grad, what=name)


# ------------------------------------------------------------------------------------- activations, dropout


def _clamp_input(bounds, layout, seed):
    """Random values, each bound exactly and one step either side of it (no NaN: stock's hardtanh gradient at
    NaN depends on the element's position, tests/test_clamp.py compares that apart)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, 4, 5, generator=gen) * 4
    flat = x.view(-1)
    k = 0
    for b in bounds:
        v = torch.tensor(b)
        for e in (v, torch.nextafter(v, torch.tensor(-9.0)), torch.nextafter(v, torch.tensor(9.0))):
            flat[k] = e
            k += 1
    return x.contiguous(memory_format=torch.channels_last) if layout else x


def test_clamp():
    """ReLU6, Hardtanh, Threshold and Hardsigmoid with the bounds of tests/test_clamp.py (exact in fp32 and not,
    threshold values on both sides of the threshold, so both the output-reading and the
    input-reading pack), in place and not, contiguous and channels_last. (Under ``dynamic=True`` the bounds are
    symbolic floats: tests/test_compile_masks.py::test_dynamic_bounds, 49 s here for this whole matrix.)"""
    factories = [(lambda ip: nn.ReLU6(ip), (0.0, 6.0)), (lambda ip: nn.Hardtanh(-1.0, 1.0, ip), (-1.0, 1.0)),
                 (lambda ip: nn.Hardtanh(-0.5, 2.5, ip), (-0.5, 2.5)),
                 (lambda ip: nn.Threshold(0.5, 2.0, ip), (0.5, 2.0)),
                 (lambda ip: nn.Threshold(0.5, -2.0, ip), (0.5, -2.0)),
                 (lambda ip: nn.Hardsigmoid(ip), (-3.0, 3.0)), (lambda ip: nn.Hardtanh(-0.1, 0.1, ip), (-0.1, 0.1)),
                 (lambda ip: nn.Threshold(0.1, -1.0, ip), (0.1,))]
    modules, inputs, calls = [], [], []
    for k, ((factory, bounds), inplace, layout) in enumerate(itertools.product(factories, (False, True),
                                                                                 (False, True))):
        modules.append(factory(inplace))
        calls.append((lambda m, x: m(x * 1)) if inplace else None)  # in place needs a non-leaf input
        inputs.append(_clamp_input(bounds, layout, k).requires_grad_())
    run_family(Branches(modules, calls), inputs)


@pytest.mark.parametrize("dynamic", [False, True])
def test_activations(dynamic):
    """ReLU and LeakyReLU (every slope of tests/test_activation.py, in place and not, contiguous and
    channels_last, the mask and the keep-output paths), the Hugging Face formula activations and the gated
    MLP activation for every activation name and (gate, up) requires_grad case. ``dynamic=True`` as well: the
    slopes become symbolic floats, and two gated Functions reading one ``math.sqrt`` constant stopped dynamo."""
    from tests.test_activation import SLOPES

    from slimgrad.functional import gated_activation
    from slimgrad.functional.gated import ACTIVATIONS
    from slimgrad.functional.hf_activations import FORMULA_ACTIVATIONS, gelu_new, gelu_python, quick_gelu

    modules, inputs, calls = [], [], []
    for slope, inplace, layout in itertools.product(SLOPES, (False, True), (False, True)):
        if inplace and slope is not None and slope < 0:
            continue  # stock refuses that backward (tested eagerly)
        module = nn.ReLU(inplace) if slope is None else nn.LeakyReLU(slope, inplace)
        x = torch.randn(2, 3, 5, 7)
        if layout:
            x = x.contiguous(memory_format=torch.channels_last)
        modules.append(module)
        calls.append((lambda m, x: m(x * 1)) if inplace else None)  # in place needs a non-leaf input
        inputs.append(x.requires_grad_())
    # keep-output path: a converted consumer (conv with a trainable weight) makes the ReLU keep its output
    modules.append(nn.Sequential(nn.ReLU(), nn.Conv2d(3, 3, 1)))
    calls.append(None)
    inputs.append(torch.randn(2, 3, 4, 4).requires_grad_())

    def keep_output(slim):  # what a previous eager step teaches the ReLU (compiled steps learn nothing)
        slim.branches[-1][0]._slimgrad_output_kept = True

    run_family(Branches(modules, calls), inputs, prepare=keep_output, dynamic=dynamic)

    class Formulas(nn.Module):
        def forward(self, inputs):
            outs = [f(inputs[0]) for f in (gelu_new, gelu_python, quick_gelu)]
            for k, kind in enumerate(ACTIVATIONS):
                gate, up = inputs[1 + 2 * (k % 3)], inputs[2 + 2 * (k % 3)]
                outs.append(gated_activation(gate, up, kind))
            return outs

    assert len(FORMULA_ACTIVATIONS) == 3
    xs = [torch.randn(2, 8).requires_grad_()]
    for rg_gate, rg_up in [(True, True), (True, False), (False, True)]:
        xs += [torch.randn(2, 8).requires_grad_(rg_gate), torch.randn(2, 8).requires_grad_(rg_up)]
    _compare_with_eager_slim(Formulas(), xs, dynamic=dynamic)


def test_dropout():
    """Dropout, Dropout1d/2d/3d (batched and not) for every p of tests/test_dropout.py, in place and not.
    The compiled path draws its mask from inductor's RNG, so values are checked for structure: each element
    dropped (0) or scaled by 1/(1-p), and the gradient the same mask times the upstream gradient."""
    from tests.test_dropout import PS

    classes = {"dropout": (nn.Dropout, (2, 3, 4, 5)), "dropout1d": (nn.Dropout1d, (2, 3, 5)),
               "dropout1d-unbatched": (nn.Dropout1d, (3, 5)), "dropout2d": (nn.Dropout2d, (2, 3, 4, 5)),
               "dropout3d": (nn.Dropout3d, (2, 3, 2, 2, 3)), "dropout3d-unbatched": (nn.Dropout3d, (3, 2, 2, 3))}
    modules, inputs, calls = [], [], []
    for (cls, shape), p, inplace in itertools.product(classes.values(), PS, (False, True)):
        modules.append(cls(p, inplace))
        calls.append((lambda m, x: m(x * 1)) if inplace else None)
        x = torch.randn(shape)
        inputs.append((x + x.sign() * 0.5).requires_grad_())
    ps = [m.p for m in modules]
    seen = iter(ps)

    def check(out_stock, out, x, grad):
        p = next(seen)
        if p == 0:
            assert_same(out, x.detach())
            return
        scale = torch.ones(()).div_(1 - p) if p < 1 else torch.zeros(())
        kept = out != 0
        assert_same(out, torch.where(kept, x.detach() * scale, 0.0), exact=False, rtol=1e-6, atol=0)
        assert grad is not None and torch.equal(grad == 0, ~kept) or p == 1

    run_family(Branches(modules, calls), inputs, check=check)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_dropout_draws_compiled_stocks_mask(dtype):
    """Compiled, the converted Dropout draws and scales as compiled stock (native_dropout's decomposition:
    rand_like(x) > p, mask * x * scale), so output and gradients are bitwise compiled stock's under the same
    seed; it keeps the mask packed. (The eager formula, empty_like(x).bernoulli_(1 - p), gave NaN outputs once
    Inductor compiled it inside a diffusers UNet with peft LoRA dropout.)"""
    torch.manual_seed(0)
    stock = nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.3), nn.Linear(32, 4)).to(dtype)
    slim = slimgrad.convert(copy.deepcopy(stock))
    x0 = torch.randn(8, 16, dtype=dtype)
    results = []
    for model in (stock, slim):
        torch._dynamo.reset()
        run = torch.compile(model, fullgraph=True)
        for grad in (True, False):
            x = x0.clone().requires_grad_(grad)
            torch.manual_seed(5)
            y = run(x)
            y.float().square().sum().backward()
            results.append((y, x.grad, model[0].weight.grad.clone()))
            model.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    for actual, expected in zip(results[2:], results[:2]):
        for a, e in zip(actual, expected):
            assert (a is None and e is None) or torch.equal(a, e)


# ---------------------------------------------------------------------------------------- LoRA, chunked loss


def test_lora_and_chunked_loss():
    """peft LoRA layers over Linear and GPT-2's Conv1D (several adapters, rsLoRA, lora_bias, bf16 base with an
    fp32 adapter, frozen and trainable base) and the chunked linear + cross-entropy loss for every reduction,
    label smoothing, soft-cap, ignore_index and bias."""
    from tests.test_lora import IN, peft_layer

    from slimgrad.functional import fused_linear_cross_entropy

    variants = [peft_layer(), peft_layer(conv1d=True), peft_layer(use_rslora=True), peft_layer(lora_bias=True),
                peft_layer(seed=3)]
    variants[-1].base_model.model.proj.base_layer.weight.requires_grad_(True)  # unfrozen base weight
    inputs = [torch.randn(3, 2, IN).requires_grad_(k % 2 == 0) for k in range(len(variants))]
    run_family(Branches(variants, [lambda m, x: m(x)] * len(variants)), inputs, exact=False)

    class Losses(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(11, 8) * 0.3)
            self.bias = nn.Parameter(torch.randn(11) * 0.1)

        def forward(self, inputs):
            h, t = inputs[0], inputs[1].detach().long()
            outs = []
            for reduction, smoothing, softcap, bias in [("mean", 0.0, None, None), ("sum", 0.1, None, self.bias),
                                                       ("none", 0.0, 3.0, None), ("mean", 0.2, 5.0, self.bias)]:
                outs.append(fused_linear_cross_entropy(h, self.weight, t, bias, reduction=reduction,
                                                       label_smoothing=smoothing, softcap=softcap, chunk_size=3))
            return outs

    target = torch.randint(0, 11, (7,)).float()
    target[2] = -100
    _compare_with_eager_slim(Losses(), [torch.randn(7, 8).requires_grad_(), target])


def test_compiled_conv_input_grad_rounding_against_compiled_stock():
    """Compiled, the conv Function feeds the convolution a view of its weight (so Inductor's layout
    optimisation saves no channels-last weight copy), which also keeps Inductor from switching the graph to
    channels-last: the input gradient comes from the contiguous kernels, compiled stock's from channels-last
    ones, the same sums in another order: within fp32 rounding (documented in README's Exactness list), and
    bitwise compiled stock's with ``layout_optimization`` off."""
    from torch._inductor import config

    torch.manual_seed(0)
    stock = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 1)).requires_grad_(False)
    slim = slimgrad.convert(copy.deepcopy(stock))
    x0 = torch.randn(2, 3, 8, 8)
    for layout_optimization in (True, False):
        grads = []
        with config.patch(layout_optimization=layout_optimization, fx_graph_cache=False):
            for model in (stock, slim):
                torch._dynamo.reset()
                x = x0.clone().requires_grad_()
                torch.compile(model, fullgraph=True)(x).square().sum().backward()
                grads.append(x.grad)
        if layout_optimization:
            torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-6)
        else:
            assert torch.equal(grads[1], grads[0])
    torch._dynamo.reset()

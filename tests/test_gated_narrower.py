"""A gated MLP keeps gate and up in the narrower dtype their producer noted they hold exactly.

In QLoRA (peft's ``prepare_model_for_kbit_training``: the hidden states fp32, bitsandbytes computing in bf16) every
value of a 4-bit layer's output is a bf16 value cast up to fp32. ``gated_activation`` then keeps gate and up in
bf16 and casts them back in backward: the same fp32 values, so outputs and gradients stay bitwise stock's, in half
the bytes. These tests check the bits against the stock expression on independent copies, the bytes kept, the
compiled core against the Python path, and that the note is dropped where it no longer holds (an in-place change).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from tests._util import assert_same

from slimgrad import csrc
from slimgrad.functional import _common
from slimgrad.functional.gated import gated_activation
from slimgrad.measure import SavedTensors

SHAPE = (4, 6, 40)
CORE = csrc.for_eager(torch.empty(0)) is not None


def _values(narrow, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(SHAPE, generator=g) * 3).to(narrow), torch.randn(SHAPE, generator=g).to(narrow)


def _run(gate_n, up_n, dy, rg, *, slim, note=True, path="core"):
    """One forward and backward on fresh fp32 copies of the narrow values: (out, dGate, dUp, bytes kept)."""
    gate = gate_n.float().requires_grad_(rg[0])
    up = up_n.float().requires_grad_(rg[1])
    g_in, u_in = gate * 1, up * 1  # non-leaf inputs, as a layer's outputs are
    if slim and note:
        _common.note_exactly_narrower(g_in, gate_n.dtype)
        _common.note_exactly_narrower(u_in, up_n.dtype)
    ctx = csrc.disabled if path == "python" else contextlib.nullcontext
    with ctx(), SavedTensors() as kept:
        out = gated_activation(g_in, u_in, "silu") if slim else F.silu(g_in) * u_in
    if slim:  # the path asked for ran
        assert ("GatedFn" in out.grad_fn.name()) == (path == "core"), out.grad_fn.name()
    with ctx():
        out.backward(dy)
    return out.detach(), gate.grad, up.grad, kept.bytes


RG = [(True, True), (True, False), (False, True)]


@pytest.mark.parametrize("path", ["core", "python"] if CORE else ["python"])
@pytest.mark.parametrize("narrow", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("rg", RG, ids=str)
def test_noted_inputs_are_kept_narrower_and_gradients_are_stock(path, narrow, rg):
    gate_n, up_n = _values(narrow, 0)
    dy = torch.randn(SHAPE, generator=torch.Generator().manual_seed(5))
    slim = _run(gate_n, up_n, dy, rg, slim=True, path=path)
    plain = _run(gate_n, up_n, dy, rg, slim=True, note=False, path=path)
    stock = _run(gate_n, up_n, dy, rg, slim=False)
    for i, name in enumerate(("output", "dGate", "dUp")):
        assert_same(slim[i], stock[i], what=f"{name} noted vs stock")
        assert_same(plain[i], stock[i], what=f"{name} not noted vs stock")
    wide_one = gate_n.numel() * 4
    # kept without the note: gate (and up where gate needs a gradient) in fp32; with it: half of that
    expected_plain = 2 * wide_one if rg[0] else wide_one
    assert plain[3] == expected_plain
    assert slim[3] == expected_plain // 2


@pytest.mark.parametrize("path", ["core", "python"] if CORE else ["python"])
def test_a_noted_input_changed_in_place_is_kept_as_it_is(path):
    gate_n, up_n = _values(torch.bfloat16, 1)
    dy = torch.randn(SHAPE, generator=torch.Generator().manual_seed(6))
    gate = gate_n.float().requires_grad_()
    up = up_n.float().requires_grad_()
    g_in, u_in = gate * 1, up * 1
    _common.note_exactly_narrower(g_in, torch.bfloat16)
    _common.note_exactly_narrower(u_in, torch.bfloat16)
    with torch.no_grad():
        g_in.add_(1e-3)  # no longer bf16 values: the note's version no longer matches
        u_in.add_(1e-3)
    assert _common.exactly_narrower(g_in) is None
    ctx = csrc.disabled if path == "python" else contextlib.nullcontext
    with ctx(), SavedTensors() as kept:
        out = gated_activation(g_in, u_in, "silu")
    with ctx():
        out.backward(dy)
    assert kept.bytes == 2 * gate_n.numel() * 4  # kept wide
    gate2 = gate_n.float().requires_grad_()
    up2 = up_n.float().requires_grad_()
    g2, u2 = gate2 * 1, up2 * 1
    with torch.no_grad():
        g2.add_(1e-3)
        u2.add_(1e-3)
    ref = F.silu(g2) * u2
    ref.backward(dy)
    assert_same(out.detach(), ref.detach(), what="output")
    assert_same(gate.grad, gate2.grad, what="dGate")
    assert_same(up.grad, up2.grad, what="dUp")


def test_only_widening_notes_are_recorded():
    x = torch.randn(3)
    _common.note_exactly_narrower(x, torch.float64)  # fp64 is not narrower than fp32
    assert _common.exactly_narrower(x) is None
    h = torch.randn(3, dtype=torch.bfloat16)
    _common.note_exactly_narrower(h, torch.float16)  # neither holds the other's values
    assert _common.exactly_narrower(h) is None
    w = torch.randn(3).to(torch.bfloat16).double()
    _common.note_exactly_narrower(w, torch.bfloat16)
    assert _common.exactly_narrower(w) is torch.bfloat16


# -- QLoRA: bitsandbytes' 4-bit gate/up projections note their fp32 outputs --------------------------------------


def _qlora_mlp(seed=0):
    bnb = pytest.importorskip("bitsandbytes")
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=160)
    mlp = LlamaMLP(cfg)
    for name in ("gate_proj", "up_proj", "down_proj"):
        ref = getattr(mlp, name)
        q = bnb.nn.Linear4bit(ref.in_features, ref.out_features, bias=False, compute_dtype=torch.bfloat16,
                              quant_type="nf4")
        q.load_state_dict(ref.state_dict())
        setattr(mlp, name, q.to("cpu"))  # quantizes
    return mlp


def _stock_and_slim_agree(stock, slim, all_saved=False):
    """One forward and backward of each MLP on the same input and output gradient: outputs and dX bit for bit;
    returns, per side, the tensors kept for backward whose storage is not a parameter's (all of them with
    ``all_saved``)."""
    g = torch.Generator().manual_seed(3)
    x0 = torch.randn(2, 12, 64, generator=g)
    dy = torch.randn(2, 12, 64, generator=g)
    results = []
    for model in (stock, slim):
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        x = x0.clone().requires_grad_()
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t, saved=saved: saved.append(t) or t, lambda t: t):
            y = model(x)
        y.backward(dy)
        kept = saved if all_saved else [t for t in saved if t.untyped_storage().data_ptr() not in params]
        results.append((y.detach(), x.grad, kept))
    (y0, dx0, _), (y1, dx1, _) = results
    assert_same(y1, y0, what="output")
    assert_same(dx1, dx0, what="dX")
    return [r[2] for r in results]


def test_qlora_mlp_keeps_gate_and_up_in_bf16_and_matches_stock():
    import slimgrad

    stock = _qlora_mlp()
    slim = slimgrad.convert(_qlora_mlp())
    kept = [sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in side}.values())
            for side in _stock_and_slim_agree(stock, slim)]
    inter = 2 * 12 * 160
    # slimgrad keeps gate and up in bf16 (2 bytes each); stock keeps gate, silu(gate) and up in fp32 plus its
    # layers' inputs (bitsandbytes hides those in ctx attributes, so SavedTensors sees only the elementwise ops')
    assert kept[1] <= 2 * inter * 2 + 4096, kept
    assert kept[1] < kept[0] / 2, kept


# -- the formula GELUs (NewGELUActivation, ...) keep their input: narrower too -----------------------------------


@pytest.mark.parametrize("kind", ["gelu_new", "gelu_python", "quick_gelu"])
def test_formula_activations_keep_a_noted_input_narrower(kind):
    """Phi-2's MLP (fc1, NewGELUActivation, fc2) in QLoRA: fc1's 4-bit output is bf16 values in fp32, the
    activation keeps it in bf16; the gradient is stock's formula's, bit for bit."""
    from slimgrad.functional import hf_activations
    from slimgrad.functional.gated import activation_forward

    x_n = (torch.randn(SHAPE, generator=torch.Generator().manual_seed(7)) * 3).bfloat16()
    dy = torch.randn(SHAPE, generator=torch.Generator().manual_seed(8))
    results = []
    for note in (False, True):
        leaf = x_n.float().requires_grad_()
        x = leaf * 1
        if note:
            _common.note_exactly_narrower(x, torch.bfloat16)
        with SavedTensors() as kept:
            y = getattr(hf_activations, kind)(x)
        y.backward(dy)
        results.append((kept.bytes, y.detach(), leaf.grad))
    ref_leaf = x_n.float().requires_grad_()
    ref = activation_forward(kind, ref_leaf * 1)  # the stock formula, as transformers writes it
    ref.backward(dy)
    assert results[0][0] == x_n.numel() * 4 and results[1][0] == x_n.numel() * 2
    for _, y, g in results:
        assert_same(y, ref.detach(), what=f"{kind} output")
        assert_same(g, ref_leaf.grad, what=f"{kind} gradient")


# -- the fused activations (F.gelu, F.silu) of GELUActivation / GELUTanh: stock's op, or the input narrower ------


@pytest.mark.parametrize("narrow", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kind", ["gelu", "gelu_pytorch_tanh", "silu"])
def test_fused_activations_keep_a_noted_input_narrower(kind, narrow):
    """Stock's F.gelu/F.silu keeps its fp32 input; noted as bf16 values, it is kept in bf16. Unnoted, stock's op
    itself runs (its own backward node): nothing to save there."""
    from slimgrad.functional.gated import activation_forward
    from slimgrad.functional.hf_activations import fused_activation

    x_n = (torch.randn(SHAPE, generator=torch.Generator().manual_seed(7)) * 3).to(narrow)
    dy = torch.randn(SHAPE, generator=torch.Generator().manual_seed(8))
    ref_leaf = x_n.float().requires_grad_()
    ref = activation_forward(kind, ref_leaf * 1)  # F.gelu / F.silu, stock
    ref.backward(dy)
    for note in (False, True):
        leaf = x_n.float().requires_grad_()
        x = leaf * 1
        if note:
            _common.note_exactly_narrower(x, narrow)
        with SavedTensors() as kept:
            y = fused_activation(x, kind)
        assert ("FormulaActivation" in y.grad_fn.name()) == note, y.grad_fn.name()
        y.backward(dy)
        assert kept.bytes == x_n.numel() * (2 if note else 4), (note, kept.bytes)
        assert_same(y.detach(), ref.detach(), what=f"{kind} output (noted: {note})")
        assert_same(leaf.grad, ref_leaf.grad, what=f"{kind} gradient (noted: {note})")
    with torch.no_grad():  # no gradient wanted: stock's op, no node
        x = x_n.float()
        _common.note_exactly_narrower(x, narrow)
        assert_same(fused_activation(x, kind), ref.detach(), what=f"{kind} under no_grad")


def _qlora_gelu_mlp(family, seed=0):
    """GPT-NeoX/Pythia's MLP (GELUActivation) or StarCoder2's (GELUTanh) with bitsandbytes 4-bit projections: the
    activation's input is a 4-bit layer's output."""
    bnb = pytest.importorskip("bitsandbytes")
    transformers = pytest.importorskip("transformers")

    torch.manual_seed(seed)
    if family == "gpt_neox":
        from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXMLP

        mlp = GPTNeoXMLP(transformers.GPTNeoXConfig(hidden_size=64, intermediate_size=160))
        names = ("dense_h_to_4h", "dense_4h_to_h")
    else:
        from transformers.models.starcoder2.modeling_starcoder2 import Starcoder2MLP

        mlp = Starcoder2MLP(transformers.Starcoder2Config(hidden_size=64, intermediate_size=160))
        names = ("c_fc", "c_proj")
    for name in names:
        ref = getattr(mlp, name)
        q = bnb.nn.Linear4bit(ref.in_features, ref.out_features, bias=ref.bias is not None,
                              compute_dtype=torch.bfloat16, quant_type="nf4")
        q.load_state_dict(ref.state_dict())
        setattr(mlp, name, q.to("cpu"))  # quantizes
    return mlp.train()


@pytest.mark.parametrize("family", ["gpt_neox", "starcoder2"])
def test_qlora_gelu_mlp_keeps_the_activation_input_in_bf16_and_matches_stock(family):
    import slimgrad

    stock = _qlora_gelu_mlp(family)
    slim = slimgrad.convert(_qlora_gelu_mlp(family))
    assert "GELU" in type(slim.act).__name__ and type(slim.act) is not type(stock.act)
    saved = _stock_and_slim_agree(stock, slim, all_saved=True)
    # the intermediate-sized tensors kept (slimgrad's 4-bit Function also keeps references to the packed weights
    # and their quant state: the model's memory, not the step's)
    kept = [[(t.dtype, t.untyped_storage().nbytes()) for t in side if t.dim() == 3 and t.shape[-1] == 160]
            for side in saved]
    inter = 2 * 12 * 160
    assert kept == [[(torch.float32, inter * 4)], [(torch.bfloat16, inter * 2)]], kept

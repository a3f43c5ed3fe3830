"""Hugging Face gated MLPs and activations after conversion, against independent stock copies: bitwise
outputs and gradients for every requires_grad combination, saved bytes at the analytical minimum, peft
LoRA on the projections, activations slimgrad cannot reproduce left alone."""

from __future__ import annotations

import copy
import importlib
import itertools

import pytest
import torch
from tests._util import assert_same
from torch import nn

transformers = pytest.importorskip("transformers")

import slimgrad  # noqa: E402
from slimgrad._registry import ORIGINALS, REPLACEMENTS  # noqa: E402
from slimgrad.convert import qualified_name  # noqa: E402
from slimgrad.integrations import hf_mlp  # noqa: E402
from slimgrad.measure import SavedTensors, saved_bytes  # noqa: E402

H, INTER = 16, 24  # hidden, intermediate
TOKENS = (2, 5)

# family -> (MLP class, config class, name of the activation option)
FAMILIES = {
    "llama": ("LlamaMLP", "LlamaConfig", "hidden_act"),
    "mistral": ("MistralMLP", "MistralConfig", "hidden_act"),
    "qwen2": ("Qwen2MLP", "Qwen2Config", "hidden_act"),
    "qwen3": ("Qwen3MLP", "Qwen3Config", "hidden_act"),
    "gemma": ("GemmaMLP", "GemmaConfig", "hidden_activation"),
    "gemma2": ("Gemma2MLP", "Gemma2Config", "hidden_activation"),
    "gemma3": ("Gemma3MLP", "Gemma3TextConfig", "hidden_activation"),
    "olmo2": ("Olmo2MLP", "Olmo2Config", "hidden_act"),
    "phi3": ("Phi3MLP", "Phi3Config", "hidden_act"),
}
DEFAULT_ACT = {"gemma": "gelu_pytorch_tanh", "gemma2": "gelu_pytorch_tanh", "gemma3": "gelu_pytorch_tanh"}
SUPPORTED_ACTS = ["silu", "swish", "gelu", "gelu_pytorch_tanh", "gelu_new", "gelu_python", "gelu_python_tanh",
                  "quick_gelu"]


def build(family, act=None, dtype=torch.float32, seed=0):
    cls_name, cfg_name, act_key = FAMILIES[family]
    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    config = getattr(transformers, cfg_name)(hidden_size=H, intermediate_size=INTER, num_attention_heads=2,
                                             num_key_value_heads=2, head_dim=8)
    setattr(config, act_key, act or DEFAULT_ACT.get(family, "silu"))
    torch.manual_seed(seed)
    return getattr(modeling, cls_name)(config).to(dtype)


def projections(mlp):
    names = ["gate_up_proj", "down_proj"] if hasattr(mlp, "gate_up_proj") else ["gate_proj", "up_proj", "down_proj"]
    return [getattr(mlp, n) for n in names]


def minimum_bytes(mlp, x, rg_x, rg_w):
    """From shapes: x for the gate/up projections whose weight trains; gate and up (one fused storage
    for gate_up_proj) when gate needs a gradient, gate alone when only up does; the product for down_proj
    when its weight trains."""
    tokens = x.numel() // H
    esize = x.element_size()
    x_bytes, inter = x.numel() * esize, tokens * INTER * esize
    *in_w, down_w = rg_w
    total = x_bytes if any(in_w) else 0
    if len(in_w) == 1:  # fused: gate and up are views of one output
        total += 2 * inter if (rg_x or in_w[0]) else 0
    else:
        need_gate, need_up = rg_x or in_w[0], rg_x or in_w[1]
        total += 2 * inter if need_gate else inter if need_up else 0
    return total + (inter if down_w else 0)


def compare(stock, slim, rg_x, rg_w, dtype, what, seed=1):
    for p_s, p_m, flag in zip(projections(stock), projections(slim), rg_w):
        p_s.weight.requires_grad_(flag)
        p_m.weight.requires_grad_(flag)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*TOKENS, H, generator=gen).to(dtype)
    g = torch.randn(*TOKENS, H, generator=gen).to(dtype)
    xs, xm = x.clone().requires_grad_(rg_x), x.clone().requires_grad_(rg_x)
    with SavedTensors(exclude=[stock]) as kept_s:
        ys = stock(xs)
    with SavedTensors(exclude=[slim]) as kept_m:
        ym = slim(xm)
    assert_same(ym, ys, what=f"{what} output")
    assert kept_m.bytes == minimum_bytes(slim, x, rg_x, rg_w), what
    assert kept_m.bytes <= kept_s.bytes, what
    if ys.requires_grad:
        ys.backward(g)
        ym.backward(g)
    assert_same(xm.grad, xs.grad, what=f"{what} dx")
    for p_s, p_m in zip(projections(stock), projections(slim)):
        assert_same(p_m.weight.grad, p_s.weight.grad, what=f"{what} dW")
        if not p_s.weight.requires_grad:
            assert p_m.weight.grad is None
    return kept_s.bytes, kept_m.bytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_every_combo(family, dtype):
    stock0 = build(family, dtype=dtype)
    n = len(projections(stock0))
    for rg_x, *rg_w in itertools.product([False, True], repeat=n + 1):
        stock = copy.deepcopy(stock0)
        slim, rep = slimgrad.convert(stock0, report=True)
        assert type(slim) is REPLACEMENTS[type(stock0)] and isinstance(slim, type(stock0))
        assert ("", type(stock0).__name__) in rep.converted and not rep.skipped
        kept_s, kept_m = compare(stock, slim, rg_x, rg_w, dtype, f"{family} {dtype} x={rg_x} w={rg_w}")
        if rg_x:  # gate and up both need grad: stock also keeps act(gate)
            assert kept_s - kept_m == (TOKENS[0] * TOKENS[1] * INTER * stock0.down_proj.weight.element_size()), family


@pytest.mark.parametrize("act", SUPPORTED_ACTS)
def test_every_supported_activation(act):
    stock0 = build("llama", act=act)
    slim, rep = slimgrad.convert(stock0, report=True)
    assert ORIGINALS.get(type(slim)) is type(stock0), rep
    compare(copy.deepcopy(stock0), slim, True, [True, False, True], torch.float32, act)
    compare(copy.deepcopy(stock0), slimgrad.convert(stock0), True, [True, True, True], torch.float32, act)


@pytest.mark.parametrize("act", ["relu2", "gelu_fast", "gelu_10", "tanh"])
def test_unsupported_activation_is_left_alone(act):
    mlp = build("llama", act=act)
    slim, rep = slimgrad.convert(mlp, report=True)
    assert type(slim) is type(mlp)
    (skip,) = [s for s in rep.skipped if s.path == ""]
    assert type(mlp.act_fn).__name__ in skip.reason


@pytest.mark.parametrize("act", ["relu", "relu6", "leaky_relu"])
def test_activation_of_a_stock_mlp_stays_stock(act):
    """An MLP left as stock for its activation keeps that activation's output in its product (for up's gradient),
    and never reports it: converted, a ReLU kept its 1-bit mask on top (+1/8 of the activation; a Llama config with
    hidden_act="relu"). The activation stays stock, said so in the report, and the step keeps what stock keeps."""
    mlp = build("llama", act=act)
    slim, rep = slimgrad.convert(mlp, report=True)
    assert type(slim) is type(mlp) and type(slim.act_fn) is type(mlp.act_fn), type(slim.act_fn)
    assert qualified_name(type(mlp.act_fn)) in rep.stock_minimal, rep
    for p in (*mlp.parameters(), *slim.parameters()):
        p.requires_grad_(False)
    x = torch.randn(*TOKENS, H)
    kept = []
    for m in (mlp, slim):
        for _ in range(2):  # (a converted ReLU would have learned by now, were there anything to learn)
            m(x.clone().requires_grad_()).sum().backward()
        with SavedTensors(exclude=[m]) as counter:
            m(x.clone().requires_grad_())
        kept.append(counter.bytes)
    assert kept[1] == kept[0], kept


def test_hooked_activation_is_left_alone_and_projection_hooks_still_fire():
    mlp = build("llama")
    handle = mlp.act_fn.register_forward_hook(lambda m, i, o: None)
    slim, rep = slimgrad.convert(mlp, report=True)
    assert type(slim) is type(mlp) and "hooks" in rep.skipped[0].reason
    handle.remove()
    calls = []
    mlp.gate_proj.register_forward_hook(lambda m, i, o: calls.append(1))
    slim = slimgrad.convert(mlp)
    assert type(slim) is not type(mlp)
    slim(torch.randn(1, 2, H))
    assert calls == [1]


def test_activation_swapped_after_conversion_runs_stock():
    mlp = build("llama")
    slim = slimgrad.convert(mlp)
    slim.act_fn = nn.Tanh()
    stock = copy.deepcopy(mlp)
    stock.act_fn = nn.Tanh()
    x = torch.randn(1, 3, H)
    assert_same(slim(x), stock(x), what="tanh fallback")


def test_other_forwards_are_not_registered():
    """Families whose MLP does something more (dropout, clamp, scale) must not be converted."""
    for module, name in [("t5gemma", "T5GemmaMLP"), ("gemma3n", "Gemma3nTextMLP"), ("bitnet", "BitNetMLP")]:
        try:
            cls = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), name)
        except (ImportError, AttributeError):
            continue
        hf_mlp.register_loaded()
        assert cls not in REPLACEMENTS, name


def test_monkey_patched_forward_is_left_alone(monkeypatch):
    mlp = build("qwen2")
    monkeypatch.setattr(type(mlp), "forward", lambda self, x: self.down_proj(self.up_proj(x)))
    slim, rep = slimgrad.convert(mlp, report=True)
    assert type(slim) is type(mlp) and "changed" in rep.skipped[0].reason


@pytest.mark.parametrize("name,kind", [("NewGELUActivation", {}), ("QuickGELUActivation", {}),
                                       ("GELUTanh", {"use_gelu_tanh_python": True}),
                                       ("GELUActivation", {"use_gelu_python": True}), ("GELUTanh", {})])
def test_activation_modules(name, kind):
    act = getattr(transformers.activations, name)(**kind)
    slim = slimgrad.convert(act)
    assert type(slim) is not type(act) and isinstance(slim, type(act))
    x = torch.randn(3, 7) * 3
    xs, xm = x.clone().requires_grad_(), x.clone().requires_grad_()
    ys = act(xs)
    kept = saved_bytes(slim, xm)
    assert kept == x.numel() * 4
    ym = slim(xm)
    g = torch.randn_like(x)
    ys.backward(g)
    ym.backward(g)
    assert_same(ym, ys, what=name)
    assert_same(xm.grad, xs.grad, what=name)
    if kind or name != "GELUTanh":
        assert saved_bytes(act, x.clone().requires_grad_()) > kept
    assert saved_bytes(slim, x) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name,kind", [("NewGELUActivation", {}), ("QuickGELUActivation", {}),
                                       ("GELUActivation", {"use_gelu_python": True})])
def test_formula_activation_step_peak_not_above_stock(name, kind, dtype):
    """The formula GELUs recompute in backward what stock kept; a backward that held every intermediate to its end
    peaked 1-3x the input above stock's step (NewGELU 3x). Each temporary is now freed after its last use, fresh
    ones updated in place: the peak is at most stock's, standalone and as the gated MLP's activation (the core's
    sequence), and the gradients stay bitwise."""
    from slimgrad.functional.gated import gated_activation
    from slimgrad.measure import peak_bytes

    act = getattr(transformers.activations, name)(**kind)
    slim = slimgrad.convert(act)
    x = (torch.randn(8, 64, 256) * 3).to(dtype)
    up = torch.randn(8, 64, 256).to(dtype)
    g = torch.randn(8, 64, 256).to(dtype)
    gated_kind = {"NewGELUActivation": "gelu_new", "QuickGELUActivation": "quick_gelu"}.get(name, "gelu_python")

    def standalone(m, xi):
        (m(xi) * g).sum().backward()
        return xi.grad

    def gated(fn, xi):
        (fn(xi) * g).sum().backward()
        return xi.grad

    for run, pair in ((standalone, (act, slim)),
                      (gated, (lambda xi: act(xi) * up, lambda xi: gated_activation(xi, up, gated_kind)))):
        grads = [run(m, x.clone().requires_grad_()) for m in pair]
        assert_same(grads[1], grads[0], what=f"{name} {run.__name__}")
        peaks = [peak_bytes(run, m, x.clone().requires_grad_()) for m in pair]
        assert peaks[1] <= peaks[0] + 16, (name, run.__name__, peaks)  # (+ a 0-dim scalar or two)


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpoint(reentrant):
    stock = build("phi3")
    slim = slimgrad.convert(stock)
    x = torch.randn(2, 3, H)
    xs, xm = x.clone().requires_grad_(), x.clone().requires_grad_()
    ys = torch.utils.checkpoint.checkpoint(stock, xs, use_reentrant=reentrant)
    ym = torch.utils.checkpoint.checkpoint(slim, xm, use_reentrant=reentrant)
    ys.sum().backward()
    ym.sum().backward()
    assert_same(ym, ys, what="out")
    assert_same(xm.grad, xs.grad, what="dx")
    for a, b in zip(slim.parameters(), stock.parameters()):
        assert_same(a.grad, b.grad, what="dW")


@pytest.mark.slow
def test_peft_lora_on_projections():
    peft = pytest.importorskip("peft")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=H, intermediate_size=INTER, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2, head_dim=8)
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(config)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"])
    stock = peft.get_peft_model(base, lora)
    for n, p in stock.named_parameters():  # non-zero B so LoRA contributes
        if "lora_B" in n:
            nn.init.normal_(p.data, std=0.1)
    mlp_type = type(base.model.layers[0].mlp)
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(3))
    # Only the MLPs converted: the saving is exactly act(gate), tokens x intermediate per layer.
    only_mlp = slimgrad.convert(stock, include=[mlp_type])
    with SavedTensors(exclude=[stock]) as kept_s:
        ls = stock(input_ids=ids, labels=ids).loss
    with SavedTensors(exclude=[only_mlp]) as kept_m:
        lo = only_mlp(input_ids=ids, labels=ids).loss
    assert kept_s.bytes - kept_m.bytes == 2 * 12 * INTER * 4
    ls.backward()
    lo.backward()
    assert_same(lo, ls, what="loss, MLPs converted")
    grads = dict(only_mlp.named_parameters())
    for n, p in stock.named_parameters():
        assert_same(grads[n].grad, p.grad, what=f"{n}, MLPs converted")
        if not p.requires_grad:
            assert grads[n].grad is None
    # Everything slimgrad knows converted (LoRA layers too, where an integration handles them).
    slim = slimgrad.convert(stock)
    mlps = [m for m in slim.modules() if ORIGINALS.get(type(m)) is mlp_type]
    assert len(mlps) == 2
    calls = []
    for m in mlps:
        for proj in (m.gate_proj, m.up_proj, m.down_proj):
            assert isinstance(proj, peft.tuners.lora.Linear)
        m.gate_proj.lora_A["default"].register_forward_hook(lambda *a: calls.append(1))
    lm = slim(input_ids=ids, labels=ids).loss
    assert calls == [1, 1]
    lm.backward()
    assert_same(lm, ls, what="loss")
    grads = dict(slim.named_parameters())
    for n, p in stock.named_parameters():
        # The LoRA integration may sum the adapter's gradient terms in another order: fp32 rounding.
        assert_same(grads[n].grad, p.grad, exact=False, rtol=1e-5, atol=1e-7, what=n)
        if not p.requires_grad:
            assert grads[n].grad is None


@pytest.mark.slow
def test_compile_fullgraph():
    stock = build("llama")
    slim = slimgrad.convert(stock)
    compiled = torch.compile(slim, fullgraph=True)
    x = torch.randn(2, 3, H)
    xs, xm = x.clone().requires_grad_(), x.clone().requires_grad_()
    ys, ym = stock(xs), compiled(xm)
    ys.sum().backward()
    ym.sum().backward()
    # Inductor may fuse and reorder element-wise arithmetic: fp32 rounding.
    assert_same(ym, ys, exact=False, rtol=1e-5, atol=1e-6)
    assert_same(xm.grad, xs.grad, exact=False, rtol=1e-5, atol=1e-6)
    for a, b in zip(slim.parameters(), stock.parameters()):
        assert_same(a.grad, b.grad, exact=False, rtol=1e-5, atol=1e-6)


_MIXTRAL_4X = '''
from torch import nn
from transformers.activations import ACT2FN


class MixtralBlockSparseTop2MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ffn_dim = config.intermediate_size
        self.hidden_dim = config.hidden_size

        self.w1 = nn.Linear(self.hidden_dim, self.ffn_dim, bias=False)
        self.w2 = nn.Linear(self.ffn_dim, self.hidden_dim, bias=False)
        self.w3 = nn.Linear(self.hidden_dim, self.ffn_dim, bias=False)

        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, hidden_states):
        current_hidden_states = self.act_fn(self.w1(hidden_states)) * self.w3(hidden_states)
        current_hidden_states = self.w2(current_hidden_states)
        return current_hidden_states
'''


@pytest.fixture
def mixtral_4x_module(monkeypatch, tmp_path):
    """transformers 4.x Mixtral's per-expert MLP (its source verbatim, as 4.57.6 ships it) in a modeling module of
    its own (a file, so that its source can be read), taken out of slimgrad's registry afterwards."""
    import importlib.util
    import sys

    name = "transformers.models.mixtral_4x.modeling_mixtral_4x"
    path = tmp_path / "modeling_mixtral_4x.py"
    path.write_text(_MIXTRAL_4X)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    cls = module.MixtralBlockSparseTop2MLP
    yield module
    replacement = REPLACEMENTS.pop(cls, None)
    ORIGINALS.pop(replacement, None)
    hf_mlp._MLP_LAYOUT.pop(cls, None)
    hf_mlp._VERIFIED.pop(cls, None)


@pytest.mark.parametrize("rg", list(itertools.product([False, True], repeat=2)), ids=str)
def test_transformers_4x_mixtral_expert_mlp_converts_bit_for_bit(mixtral_4x_module, rg):
    """transformers 4.x runs each Mixtral expert as its own MLP, ``w2(act(w1(x)) * w3(x))``: registered by that
    source (w1 the gate, w3 up, w2 down), it keeps gate and up, not act(gate), with stock's numbers."""
    cls = mixtral_4x_module.MixtralBlockSparseTop2MLP
    assert "MixtralBlockSparseTop2MLP" in hf_mlp.register_loaded()
    cfg = transformers.MixtralConfig(hidden_size=32, intermediate_size=40, hidden_act="silu")
    torch.manual_seed(0)
    stock = cls(cfg)
    slim = slimgrad.convert(copy.deepcopy(stock))
    assert type(slim) is REPLACEMENTS[cls]
    slim.w1.requires_grad_(rg[1])
    stock.w1.requires_grad_(rg[1])
    x0 = torch.randn(6, 32, generator=torch.Generator().manual_seed(1))
    results = []
    for module in (stock, slim):
        x = x0.clone().requires_grad_(rg[0])
        with SavedTensors(exclude=[module]) as kept:
            y = module(x)
        if y.requires_grad:
            y.sum().backward()
        results.append((y.detach(), x.grad, [p.grad for p in module.parameters()], kept.bytes))
    (y0, dx0, dp0, k0), (y1, dx1, dp1, k1) = results
    assert_same(y1, y0, what="output")
    assert_same(dx1, dx0, what="dX")
    for a, b in zip(dp1, dp0):
        assert_same(a, b, what="weight gradient")
    if rg[0] or rg[1]:  # act(gate), 6 x 40 fp32, no longer kept
        assert k0 - k1 == 6 * 40 * 4, (k0, k1)

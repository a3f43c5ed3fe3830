"""Simulated upstream edits: each plausible next release of transformers, peft or bitsandbytes must end in
either exact stock numbers from a converted module (the edit does not change what the code computes) or a
recorded gap, a SlimgradWarning and stock behaviour; never different numbers in silence, never an error in
an unrelated ``convert``.

The fingerprint (:mod:`slimgrad.integrations._fingerprint`) is tested directly first: cosmetic edits keep
it, edits to what the code computes change it. The edits to upstream classes run in a fresh interpreter
each (``subprocess``): slimgrad's registries are module globals filled at import, so an edit must be in
place before the integration first loads, and must not leak into other tests.
"""

from __future__ import annotations

import ast
import inspect
import os
import subprocess
import sys
import textwrap

import pytest

from slimgrad.integrations._fingerprint import Verified, fingerprint, names_read, normalise, unknown_reason
from slimgrad.integrations.hf_norms import REFERENCE_FORWARDS

# --- the fingerprint --------------------------------------------------------------------------------------

LLAMA_NORM = REFERENCE_FORWARDS["llama"][0][0]  # the source hf_norms reproduces, annotations and all
MLP = '''
def forward(self, x):
    down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
    return down_proj
'''

SAME = {
    "annotations dropped": LLAMA_NORM.replace(": torch.Tensor) -> torch.Tensor", ")"),
    "comments, blank lines, docstring, decorator": '''
@torch.no_grad
def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """RMSNorm."""
    input_dtype = hidden_states.dtype  # remember the dtype

    hidden_states = hidden_states.to(torch.float32)
    # the statistic
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden_states.to(input_dtype)
''',
    "reformatted, parameter renamed": '''
def other_name(self, x):
    input_dtype = x.dtype
    x = x.to(
        torch.float32,
    )
    variance = (x.pow(2)
                .mean(-1, keepdim=True))
    x = x * torch.rsqrt((variance + self.variance_epsilon))
    return (self.weight * x.to(input_dtype))
''',
    "temporary inlined": LLAMA_NORM.replace(
        "    variance = hidden_states.pow(2).mean(-1, keepdim=True)\n"
        "    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)\n",
        "    hidden_states = hidden_states * torch.rsqrt(hidden_states.pow(2).mean(-1, keepdim=True)"
        " + self.variance_epsilon)\n"),
}
DIFFERENT = {
    "constant": LLAMA_NORM.replace("pow(2)", "pow(3)"),
    "int constant made float": LLAMA_NORM.replace("pow(2)", "pow(2.0)"),
    "operator": LLAMA_NORM.replace("variance + self", "variance - self"),
    "call": LLAMA_NORM.replace("torch.rsqrt", "torch.sqrt"),
    "attribute": LLAMA_NORM.replace("self.variance_epsilon", "self.eps"),
    "cast moved": LLAMA_NORM.replace("return self.weight * hidden_states.to(input_dtype)",
                                     "return (self.weight * hidden_states).to(input_dtype)"),
    "new optional parameter": LLAMA_NORM.replace("hidden_states: torch.Tensor)", "hidden_states, scale=None)"),
}


@pytest.mark.parametrize("edit", sorted(SAME))
def test_cosmetic_edits_keep_the_fingerprint(edit):
    assert SAME[edit] != LLAMA_NORM
    assert fingerprint(SAME[edit]) == fingerprint(LLAMA_NORM)


@pytest.mark.parametrize("edit", sorted(SAME))
def test_names_read_agree_with_the_fingerprint(edit):
    """The cheap pre-test integrations run before fingerprinting never rejects an equal fingerprint."""
    assert names_read(SAME[edit]) == names_read(LLAMA_NORM) == {"dtype", "to", "torch", "float32", "pow", "mean",
                                                                 "rsqrt", "variance_epsilon", "weight"}
    assert names_read(DIFFERENT["attribute"]) != names_read(LLAMA_NORM)


@pytest.mark.parametrize("edit", sorted(DIFFERENT))
def test_edits_to_what_is_computed_change_the_fingerprint(edit):
    assert fingerprint(DIFFERENT[edit]) is not None
    assert fingerprint(DIFFERENT[edit]) != fingerprint(LLAMA_NORM)


@pytest.mark.parametrize("split", [
    "h = self.act_fn(self.gate_proj(x)) * self.up_proj(x)\nreturn self.down_proj(h)",
    "return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))",
    "gate = self.act_fn(self.gate_proj(x))\nreturn self.down_proj(gate * self.up_proj(x))",
    "g = self.gate_proj(x)\na = self.act_fn(g)\nh = a * self.up_proj(x)\nd = self.down_proj(h)\nreturn d",
])
def test_an_expression_split_over_statements_keeps_the_fingerprint(split):
    source = "def forward(self, x):\n" + textwrap.indent(split, "    ")
    assert fingerprint(source) == fingerprint(MLP)


@pytest.mark.parametrize("body", [
    # up_proj would run before gate_proj: calls reordered (hooks, RNG draws), not a cosmetic edit
    "t = self.up_proj(x)\nreturn self.down_proj(self.act_fn(self.gate_proj(x)) * t)",
    # a temporary read twice is computed once; inlining it would compute it twice
    "t = self.gate_proj(x)\nreturn self.down_proj(self.act_fn(t) * self.up_proj(x) * t)",
    # read only on one branch
    "t = self.act_fn(self.gate_proj(x)) * self.up_proj(x)\nreturn self.down_proj(t) if self.training else x",
])
def test_temporaries_that_change_evaluation_are_not_inlined(body):
    source = "def forward(self, x):\n" + textwrap.indent(body, "    ")
    assert "    t = " in ast.unparse(normalise(source))  # the temporary is still bound
    assert fingerprint(source) != fingerprint(MLP)


def test_fingerprint_of_live_functions_and_unreadable_ones():
    from torch import nn

    assert fingerprint(nn.Linear.forward) == fingerprint(textwrap.dedent(inspect.getsource(nn.Linear.forward)))
    assert fingerprint(len) is None  # a builtin has no source
    assert fingerprint("x = 1") is None  # not a function definition


def test_unknown_reason_names_the_function_and_known_versions():
    known = {"norm.forward": {fingerprint(LLAMA_NORM): "lib 1.0"}}
    assert unknown_reason({"norm.forward": LLAMA_NORM}, known) is None
    reason = unknown_reason({"norm.forward": DIFFERENT["constant"]}, known)
    assert "norm.forward" in reason and fingerprint(DIFFERENT["constant"]) in reason and "lib 1.0" in reason
    reason = unknown_reason({"norm.forward": None}, known)
    assert "norm.forward is missing" in reason


def test_verified_sees_a_function_replaced_after_the_check(monkeypatch):
    from slimgrad import _notices

    class Owner:
        def forward(self, x):
            return x + 1

    check = Verified({"Owner.forward": (Owner, "forward")}, {"Owner.forward": {fingerprint(Owner.forward): "v1"}},
                     classes=(Owner,), library="torch", family="test family")
    assert check.reason() is None and check.still_known()

    def forward(self, x):
        return x + 2

    monkeypatch.setattr(Owner, "forward", forward)
    assert not check.still_known()
    reason = check.reason()
    try:
        assert reason is not None and "Owner.forward" in reason
        assert _notices.class_gap(Owner).family == "test family"
    finally:
        _notices.forget_class_gap(Owner)


def test_known_tables_cover_the_installed_releases():
    """The pinned releases (constraints-tested.txt) are ones slimgrad has read: every check passes."""
    pytest.importorskip("peft")
    pytest.importorskip("bitsandbytes")
    from slimgrad.integrations import bnb, peft_lora, peft_lora_conv

    checks = [peft_lora._CHECK, *peft_lora_conv._CHECKS.values(), *bnb._CHECKS.values()]
    assert len(checks) == 1 + 3 + 6
    assert [c.reason() for c in checks] == [None] * len(checks)
    assert peft_lora._CONV1D_REASON is None


# --- simulated upstream edits, each in a fresh interpreter --------------------------------------------------

PRELUDE = '''
import copy, importlib, inspect, pathlib, sys, textwrap, warnings
import torch
from torch import nn
import slimgrad
from slimgrad import _notices
from slimgrad._registry import REPLACEMENTS

TMP = pathlib.Path({tmp!r})


def edited(source, module, name="forward"):
    """The function ``name`` of ``source`` as an upstream release would ship it: compiled from a real file
    (so inspect.getsource reads it) in the globals of upstream module ``module``."""
    path = TMP / f"edited_{{len(list(TMP.iterdir()))}}.py"
    path.write_text(textwrap.dedent(source))
    namespace = dict(vars(module))
    exec(compile(path.read_text(), str(path), "exec"), namespace)
    return namespace[name]


def upstream_source(fn, old, new):
    source = textwrap.dedent(inspect.getsource(fn))
    assert old in source, (old, source)
    return source.replace(old, new)


def convert_recording(model):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        slim = slimgrad.convert(model)
    return slim, [str(w.message) for w in caught if issubclass(w.category, slimgrad.SlimgradWarning)]


def run(model, x):
    model.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(x.is_floating_point())
    out = model(x)
    out.float().square().sum().backward()
    return out, x.grad, [p.grad for p in model.parameters()]


def assert_same_run(a, b):
    (ya, ga, pa), (yb, gb, pb) = a, b
    assert ya.dtype == yb.dtype and torch.equal(ya, yb), (ya - yb).abs().max()
    assert (ga is None and gb is None) or torch.equal(ga, gb), (ga.dtype, (ga.double() - gb.double()).abs().max())
    assert len(pa) == len(pb) and all((u is None and v is None) or torch.equal(u, v) for u, v in zip(pa, pb)), [
        None if u is None else (u.double() - v.double()).abs().max() for u, v in zip(pa, pb)]


def plain_cnn_converts():
    cnn = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    slim = slimgrad.convert(cnn)
    assert type(slim[0]) is REPLACEMENTS[nn.Conv2d] and type(slim[2]) is REPLACEMENTS[nn.ReLU]
    x = torch.randn(2, 3, 8, 8)
    assert_same_run(run(slim, x), run(copy.deepcopy(cnn), x))
'''


def _run(tmp_path, *parts: str) -> str:
    """Run ``parts`` (each dedented on its own) after :data:`PRELUDE` in a fresh interpreter."""
    code = "\n".join([PRELUDE.format(tmp=str(tmp_path)), *(textwrap.dedent(p) for p in parts), "print('DONE')\n"])
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0 and result.stdout.strip().endswith("DONE"), result.stdout + result.stderr
    return result.stdout


def test_dropped_annotation_on_llama_rms_norm_still_converts_with_stock_numbers(tmp_path):
    """transformers 5 annotates LlamaRMSNorm.forward; 4.57 does not: the edit drops (or adds) them."""
    pytest.importorskip("transformers")
    _run(tmp_path, '''
    from transformers.models.llama import modeling_llama as m
    source = textwrap.dedent(inspect.getsource(m.LlamaRMSNorm.forward))
    annotated, plain = "hidden_states: torch.Tensor) -> torch.Tensor:", "hidden_states):"
    edit = source.replace(annotated, plain) if annotated in source else source.replace(plain, annotated)
    assert edit != source
    m.LlamaRMSNorm.forward = edited(edit, m)
    torch.manual_seed(0)
    stock = m.LlamaRMSNorm(16, eps=1e-6)
    with torch.no_grad():
        stock.weight.normal_()
    slim, warned = convert_recording(stock)
    assert type(slim) is REPLACEMENTS[m.LlamaRMSNorm], type(slim)
    assert not warned and _notices.class_gap(m.LlamaRMSNorm) is None, warned
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(3, 5, 16, dtype=dtype)
        assert_same_run(run(slim, x), run(copy.deepcopy(stock), x))
    ''')


def test_gated_mlp_product_split_over_two_statements_still_converts_with_stock_numbers(tmp_path):
    pytest.importorskip("transformers")
    _run(tmp_path, '''
    from transformers.models.llama import modeling_llama as m
    m.LlamaMLP.forward = edited(upstream_source(
        m.LlamaMLP.forward,
        "down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))\\n    return down_proj",
        "h = self.act_fn(self.gate_proj(x)) * self.up_proj(x)\\n    return self.down_proj(h)"), m)
    torch.manual_seed(0)
    stock = m.LlamaMLP(m.LlamaConfig(hidden_size=16, intermediate_size=24, hidden_act="silu", num_attention_heads=2))
    slim, warned = convert_recording(stock)
    assert type(slim) is REPLACEMENTS[m.LlamaMLP], type(slim)
    assert not warned, warned
    x = torch.randn(3, 5, 16)
    assert_same_run(run(slim, x), run(copy.deepcopy(stock), x))
    ''')


def test_changed_constant_in_rms_norm_is_a_gap_left_as_stock(tmp_path):
    pytest.importorskip("transformers")
    _run(tmp_path, '''
    from transformers.models.llama import modeling_llama as m
    m.LlamaRMSNorm.forward = edited(upstream_source(m.LlamaRMSNorm.forward, "variance + self.variance_epsilon",
                                                    "variance + 2 * self.variance_epsilon"), m)
    torch.manual_seed(0)
    stock = nn.Sequential(m.LlamaRMSNorm(16, eps=1e-2), nn.Linear(16, 4))
    slim, warned = convert_recording(stock)
    assert type(slim[0]) is m.LlamaRMSNorm
    gap = _notices.class_gap(m.LlamaRMSNorm)
    assert gap is not None and gap.family == "RMSNorm" and "LlamaRMSNorm.forward" in gap.reason, gap
    assert any("LlamaRMSNorm" in w and "transformers" in w for w in warned), warned
    x = torch.randn(3, 16)
    assert_same_run(run(slim, x), run(copy.deepcopy(stock), x))
    ''')


PEFT_MODEL = '''
from peft import LoraConfig, get_peft_model
from peft.tuners.lora import layer as lora_layer
from transformers import LlamaConfig, LlamaForCausalLM


def lora_llama():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    model = LlamaForCausalLM(config)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], init_lora_weights=False)
    return get_peft_model(model, lora)


def loss_and_grads(model, ids):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters() if p.requires_grad]


def scaled_lora_forward():
    """peft's lora.Linear.forward with the adapter delta scaled differently: a plausible next release."""
    return edited(upstream_source(lora_layer.Linear.forward, "lora_B(lora_A(dropout(x))) * scaling",
                                  "lora_B(lora_A(dropout(x))) * (scaling * 0.5)"), lora_layer)


def assert_left_to_peft(stock, slim, warned):
    loras = [m for m in slim.modules() if isinstance(m, lora_layer.LoraLayer)]
    assert loras and all(type(m) is lora_layer.Linear for m in loras), {type(m) for m in loras}
    gap = _notices.class_gap(lora_layer.Linear)
    assert gap is not None and gap.family == "LoRA layer" and "lora.Linear.forward" in gap.reason, gap
    assert any("lora.layer.Linear" in w and "peft" in w for w in warned), warned
    ids = torch.randint(0, 64, (2, 7))
    (ls, gs), (lc, gc) = loss_and_grads(stock, ids), loss_and_grads(slim, ids)
    assert torch.equal(ls, lc), (ls, lc)
    # the adapters' gradients: stock's up to the one documented rounding of the converted RMSNorms (an input
    # that also feeds the residual gets its gradient summed once, not per node); a differently scaled delta
    # would be off by far more
    assert len(gs) == len(gc) == 6
    for a, b in zip(gs, gc):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
'''


def test_changed_peft_lora_forward_is_a_gap_and_the_loss_stays_stock(tmp_path):
    pytest.importorskip("peft")
    _run(tmp_path, PEFT_MODEL, '''
    lora_layer.Linear.forward = scaled_lora_forward()
    stock = lora_llama()
    slim, warned = convert_recording(stock)
    assert_left_to_peft(stock, slim, warned)
    plain_cnn_converts()
    ''')


def test_peft_lora_forward_changed_after_slimgrad_loaded_is_seen_at_the_next_convert(tmp_path):
    pytest.importorskip("peft")
    _run(tmp_path, PEFT_MODEL, '''
    stock = lora_llama()
    first, warned = convert_recording(stock)
    assert not warned, warned
    assert any(type(m) is REPLACEMENTS[lora_layer.Linear] for m in first.modules())
    lora_layer.Linear.forward = scaled_lora_forward()
    slim, warned = convert_recording(stock)
    assert_left_to_peft(stock, slim, warned)
    ''')


BNB = '''
import logging
logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
import bitsandbytes.nn.modules as bm
import peft  # imports bitsandbytes' integration too: the case where every convert used to raise


def linear_4bit():
    torch.manual_seed(0)
    ref = nn.Linear(32, 16)
    layer = bm.Linear4bit(32, 16, compute_dtype=torch.float32, quant_type="nf4")
    layer.load_state_dict(ref.state_dict())
    return layer.to("cpu")
'''


def test_renamed_bnb_helper_is_a_gap_and_unrelated_converts_work(tmp_path):
    pytest.importorskip("bitsandbytes")
    pytest.importorskip("peft")
    _run(tmp_path, '''
    import bitsandbytes.nn.modules as bm
    bm.fix_4bit_quant_state = bm.fix_4bit_weight_quant_state_from_module  # the helper renamed upstream
    del bm.fix_4bit_weight_quant_state_from_module
    ''', BNB, '''
    plain_cnn_converts()
    model = nn.Sequential(bm.Linear4bit(32, 16, quant_type="nf4"), bm.Linear8bitLt(16, 8, has_fp16_weights=False))
    slim, warned = convert_recording(model)
    assert type(slim[0]) is bm.Linear4bit and type(slim[1]) is REPLACEMENTS[bm.Linear8bitLt]
    for cls in (bm.Linear4bit, bm.LinearFP4, bm.LinearNF4):
        gap = _notices.class_gap(cls)
        assert gap is not None and gap.family == "bitsandbytes linear", (cls, gap)
        assert "fix_4bit_weight_quant_state_from_module is missing" in gap.reason, gap.reason
        assert cls not in REPLACEMENTS
    assert any("Linear4bit" in w and "bitsandbytes" in w for w in warned), warned
    assert not _notices.integration_gaps()
    ''')


def test_new_optional_parameter_on_bnb_forward_is_a_gap_with_stock_numbers(tmp_path):
    pytest.importorskip("bitsandbytes")
    pytest.importorskip("peft")
    _run(tmp_path, '''
    import bitsandbytes.nn.modules as bm
    bm.Linear4bit.forward = edited(upstream_source(bm.Linear4bit.forward, "def forward(self, x: torch.Tensor):",
                                                   "def forward(self, x: torch.Tensor, out_dtype=None):"), bm)
    ''', BNB, '''
    plain_cnn_converts()
    stock = linear_4bit()
    slim, warned = convert_recording(stock)
    assert type(slim) is bm.Linear4bit
    gap = _notices.class_gap(bm.Linear4bit)
    assert gap is not None and "Linear4bit.forward" in gap.reason, gap
    assert any("Linear4bit" in w for w in warned), warned
    assert not _notices.integration_gaps()
    x = torch.randn(3, 32)
    assert_same_run(run(slim, x), run(copy.deepcopy(stock), x))
    ''')


def test_an_integration_that_fails_to_import_disables_only_itself(tmp_path):
    """bitsandbytes' integration import fails (here: a slimgrad function it imports is gone): a warning
    naming library and version, an integration gap, no registration left behind, and every other convert
    unchanged; the gap is warned about once."""
    pytest.importorskip("bitsandbytes")
    pytest.importorskip("peft")
    _run(tmp_path, '''
    import slimgrad.functional.quantized as q
    del q.linear_4bit
    ''', BNB, '''
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plain_cnn_converts()
    messages = [str(w.message) for w in caught if issubclass(w.category, slimgrad.SlimgradWarning)]
    assert len(messages) == 1 and "bnb" in messages[0] and "bitsandbytes" in messages[0], messages
    assert "linear_4bit" in messages[0], messages
    [gap] = [g for g in _notices.integration_gaps() if g.subject == "bnb"]
    assert gap.library == "bitsandbytes" and gap.version == _notices.library_version("bitsandbytes")
    assert bm.Linear4bit not in REPLACEMENTS and bm.Linear8bitLt not in REPLACEMENTS
    from peft.tuners.lora import layer as lora_layer
    assert lora_layer.Linear in REPLACEMENTS  # peft's own integration is unaffected
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plain_cnn_converts()
    assert not [w for w in caught if issubclass(w.category, slimgrad.SlimgradWarning)]
    ''')


def test_a_failing_integration_leaves_no_partial_registration(tmp_path):
    """An integration module that registers a class and then raises: the registration is undone."""
    (tmp_path / "drift_broken.py").write_text(textwrap.dedent('''
        from torch import nn
        from slimgrad._registry import register_forward

        class Dummy(nn.Module):
            def forward(self, x):
                return x

        register_forward(Dummy, lambda self, x: x, module=__name__)
        raise RuntimeError("upstream changed something")
    '''))
    _run(tmp_path, '''
    import slimgrad.integrations as integrations
    integrations.__path__.append(str(TMP))
    integrations.INTEGRATIONS["torch"] = ("drift_broken",)
    before = dict(REPLACEMENTS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plain_cnn_converts()
    assert dict(REPLACEMENTS) == before
    messages = [str(w.message) for w in caught if issubclass(w.category, slimgrad.SlimgradWarning)]
    assert any("drift_broken" in m and "upstream changed something" in m for m in messages), messages
    ''')

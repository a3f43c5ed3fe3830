"""A requested feature never fails silently: ``convert`` warns (WARNING log + SlimgradWarning, also with
``report=True``) about every module of a claimed family it leaves as stock, every option that engages on
nothing and every disabled integration of a library the model uses; ``strict=True`` raises instead, before
anything is swapped. Also the other silent outcomes of issue 21: LoRA layers peft adds after ``convert``,
TorchScript of a converted model, stock class names in reprs."""

from __future__ import annotations

import copy
import logging
import re
import warnings

import pytest
import torch
from torch import nn

import slimgrad
from slimgrad import _gaps, _notices
from slimgrad._notices import SlimgradGapError, SlimgradWarning
from slimgrad._registry import OPTIONS, ORIGINALS, REPLACEMENTS, register


@pytest.fixture(autouse=True)
def _fresh_notices():
    _notices.reset_warned()
    yield
    _notices.reset_warned()


class MyRMSNorm(nn.Module):
    """A norm of a claimed family (by name) that no integration registers."""

    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class GatedMLP(nn.Module):
    """A gated MLP (gate/up/down children) whose forward no integration recognised."""

    def __init__(self, n=8, h=12):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(n, h), nn.Linear(n, h), nn.Linear(h, n)

    def forward(self, x):
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


def model_with_gaps():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), MyRMSNorm(8), GatedMLP(), nn.Dropout(0.1))


def _gap_warnings(record) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, SlimgradWarning)]


def test_claimed_family_left_as_stock_warns_even_with_report(caplog):
    model = model_with_gaps()
    with caplog.at_level(logging.INFO, logger="slimgrad"), warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        slim, report = slimgrad.convert(model, report=True)
    messages = _gap_warnings(record)
    assert len(messages) == 2
    assert any("RMSNorm" in m and "MyRMSNorm" in m and "local code" in m for m in messages)
    assert any("gated MLP" in m and "GatedMLP" in m for m in messages)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert sorted(warned) == sorted(messages)  # WARNING level on the logger too, report=True notwithstanding
    assert [g.subject.rsplit(".", 1)[-1] for g in report.gaps] == ["MyRMSNorm", "GatedMLP"]
    assert "gap: slimgrad: RMSNorm" in str(report) and "[1 module(s): 2]" in str(report)
    assert type(slim[1]) is slimgrad.nn.ReLU and type(slim[2]) is MyRMSNorm  # the rest still converts
    x = torch.randn(3, 4)
    torch.manual_seed(1)
    expected = model.eval()(x)
    assert torch.equal(slim.eval()(x.clone()), expected)  # the gap runs stock's numbers


class FeedForward(nn.Module):
    """A gated MLP in Meta's reference naming (w1 gate, w3 up, w2 down), torchtune's FeedForward; left as stock
    without a word before (loops44)."""

    def __init__(self, n=8, h=12):
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(n, h, bias=False), nn.Linear(h, n, bias=False), nn.Linear(n, h,
                                                                                                         bias=False)

    def forward(self, x):
        return self.w2(torch.nn.functional.silu(self.w1(x)) * self.w3(x))


def test_gated_mlp_in_w1_w2_w3_naming_left_as_stock_is_a_gap():
    model = nn.Sequential(nn.Linear(4, 8), FeedForward())
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _, report = slimgrad.convert(model, report=True)
    assert [g.subject.rsplit(".", 1)[-1] for g in report.gaps] == ["FeedForward"]
    assert any("gated MLP" in m and "FeedForward" in m for m in _gap_warnings(record))


def test_exported_at_package_level():
    assert slimgrad.SlimgradWarning is SlimgradWarning and slimgrad.SlimgradGapError is SlimgradGapError


def test_warns_once_per_class_and_reason():
    model = model_with_gaps()
    with pytest.warns(SlimgradWarning):
        slimgrad.convert(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second conversion of the same classes says nothing new
        slimgrad.convert(model)


def test_strict_raises_naming_every_gap_and_swaps_nothing():
    model = model_with_gaps()
    before = [type(m) for m in model.modules()]
    with pytest.raises(SlimgradGapError, match=r"(?s)MyRMSNorm.*GatedMLP.*strict=True"):
        slimgrad.convert(model, inplace=True, strict=True)
    assert [type(m) for m in model.modules()] == before  # inplace, yet nothing swapped
    with pytest.raises(TypeError, match="'strict' must be True or False"):
        slimgrad.convert(model, strict="yes")


def test_modules_the_user_excluded_are_not_gaps():
    model = model_with_gaps()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        slim, report = slimgrad.convert(model, exclude=["2", "3"], report=True)
        assert report.gaps == []
        slimgrad.convert(model, include=["1"], strict=True)
    assert type(slim[1]) is slimgrad.nn.ReLU


def test_recorded_class_gap_names_library_version_and_reason():
    class Norm(nn.Module):
        def forward(self, x):
            return x

    gap = _notices.record_class_gap(Norm, library="torch", family="norm", reason="forward edited upstream")
    try:
        version = re.escape(torch.__version__)
        with pytest.warns(SlimgradWarning, match=rf"norm .*Norm is left as stock \(torch {version}\): forward edited"):
            _, report = slimgrad.convert(nn.Sequential(Norm(), nn.ReLU()), report=True)
        assert report.gaps == [gap]
    finally:
        _notices._CLASS_GAPS.pop(Norm, None)


def test_chunked_loss_gap_only_when_asked():
    class Head(nn.Module):
        def forward(self, x):
            return x

    _notices.record_class_gap(Head, library="torch", family="chunked_loss", reason="loss function unknown")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            slimgrad.convert(nn.Sequential(Head()))  # not asked for: not a gap
        with pytest.raises(SlimgradGapError, match="loss function unknown"):
            slimgrad.convert(nn.Sequential(Head()), chunked_loss=True, strict=True)
    finally:
        _notices._CLASS_GAPS.pop(Head, None)


def test_chunked_loss_engaging_on_nothing_warns():
    cnn = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())
    with pytest.warns(SlimgradWarning, match=r"chunked_loss=True\) engaged on nothing"):
        slim, report = slimgrad.convert(cnn, chunked_loss=True, report=True)
    assert report.gaps[0].family == "chunked_loss" and type(slim[0]) is slimgrad.nn.Conv2d
    with pytest.raises(SlimgradGapError, match="engaged on nothing"):
        slimgrad.convert(cnn, chunked_loss=True, strict=True)


def test_option_gated_replacement_declining_is_a_gap():
    class Head(nn.Module):
        def __init__(self, ok):
            super().__init__()
            self.ok = ok

        def forward(self, x):
            return x

    @register(Head, option="chunked_loss")
    class SlimHead(Head):
        @classmethod
        def unsupported_reason(cls, module):
            return None if module.ok else "lm_head is not a Linear"

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            slim = slimgrad.convert(nn.Sequential(Head(True), Head(True)), chunked_loss=True)
        assert type(slim[0]) is SlimHead
        with pytest.warns(SlimgradWarning, match="chunked_loss .*Head is left as stock .*lm_head is not a Linear"):
            slim, report = slimgrad.convert(nn.Sequential(Head(False)), chunked_loss=True, report=True)
        assert type(slim[0]) is Head and len(report.gaps) == 1  # and no "engaged on nothing" on top
        assert [(s.path, s.reason) for s in report.skipped] == [("0", "lm_head is not a Linear")]
    finally:
        del REPLACEMENTS[Head], ORIGINALS[SlimHead], OPTIONS[Head]


def test_integration_gap_only_for_models_using_that_library():
    library = _gaps.library_of(MyRMSNorm)[0]  # this test module's package stands for a library
    _notices.record_integration_gap(library, "slimgrad.integrations.fake", "import failed: no module named x")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            slimgrad.convert(nn.Sequential(nn.Conv2d(1, 1, 1)), strict=True)  # does not use it: unchanged
        with pytest.warns(SlimgradWarning, match=r"integration slimgrad.integrations.fake .*import failed"):
            _, report = slimgrad.convert(nn.Sequential(MyRMSNorm(4)), report=True)
        # the disabled integration explains the norm: no second, per-class gap
        assert [g.family for g in report.gaps] == ["integration"]
    finally:
        _notices.forget_integration_gap("slimgrad.integrations.fake")


# -- reprs, TorchScript ---------------------------------------------------------------------------------------


def small_cnn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Dropout(0.1), nn.Flatten(),
                         nn.Linear(144, 2))


def test_reprs_show_stock_class_names():
    model = small_cnn()
    slim = slimgrad.convert(model)
    assert type(slim[0]) is not nn.Conv2d and repr(slim) == repr(model)


def test_torchscript_names_slimgrad_and_revert():
    model = small_cnn().eval()
    slim = slimgrad.convert(model)
    x = torch.randn(2, 3, 8, 8)
    with pytest.raises(RuntimeError, match=r"slimgrad: torch.jit.script .*Conv2d.*slimgrad.revert\(model\)"):
        torch.jit.script(slim)
    with pytest.raises(RuntimeError, match=r"slimgrad: torch.jit.trace .*slimgrad.revert\(model\)"):
        torch.jit.trace(slim, x)
    with pytest.raises(RuntimeError, match=r"slimgrad: torch.jit.trace .*ReLU"):  # a function calling a module
        torch.jit.trace(lambda t: slim[2](t), x)
    # the advice works: reverted, it traces and scripts to stock's numbers
    reverted = slimgrad.revert(copy.deepcopy(slim))
    assert torch.equal(torch.jit.trace(reverted, x)(x), model(x.clone()))
    assert torch.equal(torch.jit.script(reverted)(x), model(x.clone()))


# -- peft: LoRA layers added after convert, reprs -------------------------------------------------------------


def tiny_llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2)
    return transformers.LlamaForCausalLM(cfg)


def test_convert_before_get_peft_model_warns():
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"])
    early = slimgrad.convert(tiny_llama())
    with pytest.warns(SlimgradWarning, match=r"LoRA layer peft\.tuners\.lora\.layer\.Linear .*peft .*"
                                             r"get_peft_model, add_adapter.*convert\(model, inplace=True\) again"):
        peft.get_peft_model(early, config)
    # the right order: converting after get_peft_model converts the adapters and says nothing of the kind
    with warnings.catch_warnings():
        warnings.simplefilter("error", SlimgradWarning)
        late = slimgrad.convert(peft.get_peft_model(tiny_llama(), config), inplace=True)
        slimgrad.convert(late, inplace=True)  # converting again registers nothing new
    assert sum(type(m).__qualname__ == "SlimLinear" for m in late.modules()) == 2
    # an adapter on new layers added to a converted model: the warning's advice (convert again) converts them
    _notices.reset_warned()
    with pytest.warns(SlimgradWarning, match=r"add_adapter.*convert\(model, inplace=True\) again"):
        late.add_adapter("second", peft.LoraConfig(r=2, target_modules=["k_proj"]))
    slimgrad.convert(late, inplace=True)
    assert sum(type(m).__qualname__ == "SlimLinear" for m in late.modules()) == 3


def test_lora_reprs_keep_peft_names():
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"])
    stock = peft.get_peft_model(tiny_llama(), config)
    slim = slimgrad.convert(stock)
    assert type(slim.base_model.model.model.layers[0].self_attn.q_proj).__qualname__ == "SlimLinear"
    assert repr(slim) == repr(stock) and "lora.Linear(" in repr(slim)


def test_lora_layer_without_replacement_is_a_gap():
    pytest.importorskip("peft")
    from peft.tuners.lora.layer import LoraLayer

    class CustomLora(nn.Module, LoraLayer):  # a LoRA layer type no integration converts
        def __init__(self):
            nn.Module.__init__(self)
            LoraLayer.__init__(self, nn.Linear(4, 4))

        def forward(self, x):
            return self.base_layer(x)

    with pytest.warns(SlimgradWarning, match="LoRA layer .*CustomLora is left as stock"):
        _, report = slimgrad.convert(nn.Sequential(CustomLora()), report=True)
    assert [g.family for g in report.gaps] == ["LoRA layer"]


def test_claimed_family_declined_by_its_replacement_warns_with_report(caplog):
    model = tiny_llama()
    mlp = model.model.layers[0].mlp
    mlp.act_fn.register_forward_hook(lambda m, i, o: None)  # the replacement declines a hooked activation
    with caplog.at_level(logging.INFO, logger="slimgrad"), pytest.warns(SlimgradWarning, match="gated MLP .*LlamaMLP"):
        slim, report = slimgrad.convert(model, report=True)
    assert type(slim.model.layers[0].mlp) is type(mlp)
    assert [g.family for g in report.gaps] == ["gated MLP"] and "hooks" in report.gaps[0].reason
    assert report.gap_paths[report.gaps[0].subject] == ["model.layers.0.mlp"]
    assert [s.path for s in report.skipped] == ["model.layers.0.mlp"]
    assert any(r.levelno == logging.WARNING and "LlamaMLP" in r.getMessage() for r in caplog.records)
    ids = torch.randint(0, 64, (1, 5))
    assert torch.equal(slim(input_ids=ids).logits, model(input_ids=ids.clone()).logits)

"""convert / revert keep everything a user relies on: identity, parameters, hooks, state, flags."""

import copy
import logging

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

import slimgrad
from slimgrad._registry import ORIGINALS, REPLACEMENTS, register


def small_cnn():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 8, 3, padding=1, bias=False),
        nn.Dropout(0.2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
    )


def test_default_converts_a_copy_and_leaves_the_original_alone():
    model = small_cnn()
    model[0].weight.requires_grad_(False)
    before = {n: type(m) for n, m in model.named_modules()}
    slim = slimgrad.convert(model)
    assert slim is not model
    assert {n: type(m) for n, m in model.named_modules()} == before
    assert type(slim[0]) is slimgrad.nn.Conv2d and isinstance(slim[0], nn.Conv2d)
    for (n1, p1), (n2, p2) in zip(model.named_parameters(), slim.named_parameters()):
        assert n1 == n2 and p1 is not p2 and torch.equal(p1, p2)
        assert p1.requires_grad == p2.requires_grad
    assert slim[0].weight.requires_grad is False
    assert list(model.state_dict()) == list(slim.state_dict())


def test_inplace_shares_parameters_and_keeps_identity():
    model = small_cnn()
    params = {n: p for n, p in model.named_parameters()}
    out = slimgrad.convert(model, inplace=True)
    assert out is model
    assert all(p is params[n] for n, p in model.named_parameters())
    assert type(model[1]) is slimgrad.nn.BatchNorm2d
    # Linear keeps what stock keeps; its replacement only tells a ReLU before it that it keeps the ReLU's output
    assert type(model[8]) is slimgrad.nn.Linear and isinstance(model[8], nn.Linear)


def test_outputs_and_gradients_match_stock():
    stock = small_cnn()
    slim = slimgrad.convert(stock)
    x = torch.randn(2, 3, 8, 8)
    xs, xg = x.clone().requires_grad_(), x.clone().requires_grad_()
    torch.manual_seed(1)
    stock.eval()
    slim.eval()  # eval: dropout is identity in both, so outputs must be bitwise equal
    a, b = stock(xs), slim(xg)
    assert torch.equal(a, b)
    a.sum().backward()
    b.sum().backward()
    assert torch.equal(xs.grad, xg.grad)
    for p, q in zip(stock.parameters(), slim.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_hooks_modes_dtype_and_memory_format_survive():
    model = small_cnn().to(torch.float64).to(memory_format=torch.channels_last)
    calls = []
    model[0].register_forward_hook(lambda m, i, o: calls.append("fwd"))
    model[0].register_forward_pre_hook(lambda m, i: calls.append("pre"))
    model[2].register_full_backward_hook(lambda m, gi, go: calls.append("bwd"))
    model.eval()
    model[5].train()
    slim = slimgrad.convert(model)
    assert slim.training is False and slim[5].training is True
    assert slim[0].weight.dtype == torch.float64
    assert slim[0].weight.is_contiguous(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64, requires_grad=True)
    slim(x).sum().backward()
    assert calls == ["pre", "fwd", "bwd"]


def test_subclasses_and_parametrized_modules_are_left_alone_and_reported(caplog):
    class MyConv(nn.Conv2d):
        def forward(self, x):  # (one reaching super().forward is converted: tests/test_subclass_forward.py)
            return self._conv_forward(x, self.weight * 2, self.bias)

    class Positive(nn.Module):
        def forward(self, w):
            return w.abs()

    model = nn.Sequential(MyConv(3, 3, 1), nn.Conv2d(3, 3, 1))
    parametrize.register_parametrization(model[1], "weight", Positive())
    with caplog.at_level(logging.INFO, logger="slimgrad"):
        slim, report = slimgrad.convert(model, report=True)
    # the caller asked for the report: the skipped modules are logged at info, not warned about
    assert caplog.records and all(r.levelno == logging.INFO for r in caplog.records)
    assert type(slim[0]) is MyConv
    assert type(slim[1]) is type(model[1])  # the Parametrized class, untouched
    reasons = {s.path: s.reason for s in report.skipped}
    assert "subclass" in reasons["0"] and "parametriz" in reasons["1"]
    assert "MyConv" in caplog.text and "parametriz" in caplog.text
    x = torch.randn(1, 3, 4, 4)
    assert torch.equal(slim(x), model(x))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="slimgrad"):
        slimgrad.convert(model)  # without report=True, the warning is the only way to learn of them
    assert any(r.levelno == logging.WARNING and "MyConv" in r.getMessage() for r in caplog.records)


class _InitConv(nn.Conv2d):
    """Only set-up, as transformers' EfficientNetDepthwiseConv2d: a depthwise Conv2d with its own arguments."""

    def __init__(self, channels, tag="dw"):
        super().__init__(channels, channels, 3, padding=1, groups=channels, bias=False)
        self.tag = tag  # state a forward never reads

    def reset_parameters(self):
        super().reset_parameters()

    def extra_repr(self):
        return super().extra_repr() + f", tag={self.tag}"


class _InitGroupNorm(nn.GroupNorm):
    def __init__(self, channels):
        super().__init__(1, channels)


class _InitReLU(nn.ReLU):
    pass


class _FromInitConv(_InitConv):  # two levels of set-up only
    def __init__(self, channels):
        super().__init__(channels, tag="deep")


def _init_only_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), _InitGroupNorm(8), _InitReLU(), _InitConv(8),
                         _FromInitConv(8), nn.Flatten(), nn.Linear(8 * 6 * 6, 2))


def test_subclasses_that_add_only_set_up_are_converted_bitwise_and_keep_less():
    """A subclass that defines only __init__ (reset_parameters, extra_repr) computes what its base computes: it
    gets a twin of the base's replacement, keeps its own type for isinstance and printing, keeps less than stock
    where the base's replacement does, gives stock's bits, and reverts to itself."""
    model = _init_only_model()
    slim, report = slimgrad.convert(model, report=True)
    assert not report.skipped, report.skipped
    for i, kind in ((1, _InitGroupNorm), (2, _InitReLU), (3, _InitConv), (4, _FromInitConv)):
        assert type(slim[i]) is not kind and isinstance(slim[i], kind) and type(slim[i]) in ORIGINALS
        assert ORIGINALS[type(slim[i])] is kind and type(model[i]) is kind  # the original is left alone
    assert isinstance(slim[3], slimgrad.nn.Conv2d) and isinstance(slim[1], slimgrad.nn.GroupNorm)
    assert "_InitConv(8, 8" in repr(slim) and "tag=dw" in repr(slim) and repr(slim) == repr(model)
    assert slim.state_dict().keys() == model.state_dict().keys()
    for trains_weights in (False, True):
        a, b = copy.deepcopy(model), copy.deepcopy(slim)
        for m in (a, b):
            m.requires_grad_(trains_weights)
        x = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(1))
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        b(xb).sum().backward()  # a ReLU learns in its first step whether its consumer keeps its output
        xb.grad = None
        b.zero_grad(set_to_none=True)
        kept_a = slimgrad.saved_bytes(lambda a=a, xa=xa: a(xa), exclude=[a])
        kept_b = slimgrad.saved_bytes(lambda b=b, xb=xb: b(xb), exclude=[b])
        assert kept_b <= kept_a and (trains_weights or kept_b < kept_a), (trains_weights, kept_a, kept_b)
        a(xa).square().sum().backward()
        b(xb).square().sum().backward()
        assert torch.equal(xa.grad, xb.grad)
        for pa, pb in zip(a.parameters(), b.parameters()):
            assert (pa.grad is None) == (pb.grad is None) and (pa.grad is None or torch.equal(pa.grad, pb.grad))
    slimgrad.revert(slim)
    assert [type(m) for m in slim] == [type(m) for m in model]
    # a type named in include/exclude also selects its subclasses that add only set-up
    kept_stock = slimgrad.convert(model, exclude=[nn.Conv2d])
    assert [type(m) for m in kept_stock][:5:4] == [nn.Conv2d, _FromInitConv] and type(kept_stock[3]) is _InitConv
    only_convs = slimgrad.convert(model, include=nn.Conv2d)
    assert type(only_convs[3]) is not _InitConv and type(only_convs[1]) is _InitGroupNorm


def test_a_converted_init_only_subclass_pickles_into_a_new_process(tmp_path):
    """torch.save of a whole converted model names each twin; a new process rebuilds it from that name."""
    import subprocess
    import sys

    path = tmp_path / "model.pt"
    slim = slimgrad.convert(_init_only_model())
    torch.save(slim, path)
    x = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(1))
    torch.save((x, slim(x)), tmp_path / "io.pt")
    code = (f"import sys, torch; sys.path.insert(0, {str(__import__('pathlib').Path(__file__).parent)!r}); "
            f"m = torch.load({str(path)!r}, weights_only=False); x, y = torch.load({str(tmp_path / 'io.pt')!r}); "
            "assert type(m[3]).__name__ == '_InitConv' and type(m[3]).__module__ == 'slimgrad._registry'; "
            "assert torch.equal(m(x), y); print('ok')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.stdout.strip().endswith("ok"), done.stderr[-2000:]


def test_converted_hf_layers_unpickle_whatever_the_process_saw_before(tmp_path):
    """The Slim<Stock> classes of the Hugging Face integrations exist once their integration has seen the modeling
    module: a layer saved on its own, or a model loaded after something else was converted, could not be loaded
    ("Can't get attribute 'SlimQwen2RMSNorm'"; the processes sweep). They pickle by their stock class now."""
    import subprocess
    import sys

    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    torch.manual_seed(0)
    norm = slimgrad.convert(nn.Sequential(Qwen2RMSNorm(8)))[0]
    assert type(norm).__qualname__ == "SlimQwen2RMSNorm"
    config = transformers.Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1)
    model = slimgrad.convert(transformers.Qwen2ForCausalLM(config))
    torch.save(norm, tmp_path / "norm.pt")
    torch.save(model, tmp_path / "model.pt")
    x = torch.randn(2, 8)
    torch.save((x, norm(x)), tmp_path / "io.pt")
    code = (
        "import sys, torch, torch.nn as nn, slimgrad; "
        # a converted model of another family first: the integrations are imported before Qwen2's module is
        "slimgrad.convert(nn.Sequential(nn.Conv2d(1, 1, 1), nn.ReLU())); "
        f"norm = torch.load({str(tmp_path / 'norm.pt')!r}, weights_only=False); "
        f"model = torch.load({str(tmp_path / 'model.pt')!r}, weights_only=False); "
        f"x, y = torch.load({str(tmp_path / 'io.pt')!r}); "
        "assert type(norm).__qualname__ == 'SlimQwen2RMSNorm' and torch.equal(norm(x), y); "
        "assert type(model.model.norm).__qualname__ == 'SlimQwen2RMSNorm'; "
        "assert type(model.model.layers[0].mlp).__qualname__ == 'SlimQwen2MLP'; print('ok')"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.stdout.strip().endswith("ok"), done.stderr[-2000:]


def test_subclasses_that_define_more_than_set_up_are_left_alone_naming_what_they_define():
    class Scaled(nn.Conv2d):
        def _conv_forward(self, input, weight, bias):
            return super()._conv_forward(input, weight * 2, bias)

    class WithProperty(nn.ReLU):
        @property
        def inplace(self):
            return False

        @inplace.setter
        def inplace(self, value):
            pass

    model = nn.Sequential(Scaled(3, 3, 1), WithProperty())
    slim, report = slimgrad.convert(model, report=True)
    assert [type(m) for m in slim] == [Scaled, WithProperty]
    reasons = {s.path: s.reason for s in report.skipped}
    assert "defines _conv_forward" in reasons["0"] and "defines inplace" in reasons["1"], reasons
    x = torch.randn(1, 3, 4, 4)
    assert torch.equal(slim(x), model(x))


def test_include_exclude_patterns_and_types():
    model = small_cnn()
    only_first = slimgrad.convert(model, include=["0"])
    assert type(only_first[0]) is slimgrad.nn.Conv2d and type(only_first[4]) is nn.Conv2d
    no_bn = slimgrad.convert(model, exclude=[nn.BatchNorm2d])
    assert type(no_bn[1]) is nn.BatchNorm2d and type(no_bn[0]) is slimgrad.nn.Conv2d
    both = slimgrad.convert(model, include="*", exclude="4")
    assert type(both[4]) is nn.Conv2d and type(both[0]) is slimgrad.nn.Conv2d

    nested = nn.Sequential(nn.Sequential(nn.Conv2d(1, 1, 1), nn.ReLU()), nn.ReLU())
    out = slimgrad.convert(nested, include="0")  # a pattern covers everything inside the module
    assert type(out[0][0]) is slimgrad.nn.Conv2d and type(out[0][1]) is slimgrad.nn.ReLU
    assert type(out[1]) is nn.ReLU


def test_bad_arguments_give_clear_errors():
    model = small_cnn()
    with pytest.raises(TypeError, match="'model' must be a torch.nn.Module"):
        slimgrad.convert(torch.zeros(1))
    with pytest.raises(ValueError, match="'include' pattern 'nope' matches no module"):
        slimgrad.convert(model, include=["nope"])
    with pytest.raises(ValueError, match="'exclude' names type Embedding"):
        slimgrad.convert(model, exclude=[nn.Embedding])
    with pytest.raises(TypeError, match="'include' entries"):
        slimgrad.convert(model, include=[3])
    with pytest.raises(TypeError, match="'inplace'"):
        slimgrad.convert(model, inplace="yes")
    with pytest.raises(TypeError, match="'model'"):
        slimgrad.revert("model")


def test_convert_twice_is_idempotent_and_shared_modules_convert_once():
    conv = nn.Conv2d(2, 2, 1)
    model = nn.Sequential(conv, nn.ReLU(), conv)
    once = slimgrad.convert(model)
    assert once[0] is once[2] and type(once[0]) is slimgrad.nn.Conv2d
    twice, report = slimgrad.convert(once, inplace=True, report=True)
    assert twice is once and report.converted == [] and report.skipped == []


def test_revert_restores_stock_classes_and_state_dicts_move_both_ways():
    model = small_cnn()
    slim = slimgrad.convert(model)
    slim.train()
    slim(torch.randn(2, 3, 8, 8)).sum().backward()  # runtime bookkeeping attributes get set
    stock_again = slimgrad.revert(copy.deepcopy(slim))
    assert all(type(m) not in ORIGINALS for m in stock_again.modules())
    assert not any("_slimgrad" in k for m in stock_again.modules() for k in vars(m))
    fresh = small_cnn()
    fresh.load_state_dict(slim.state_dict())
    for a, b in zip(fresh.state_dict().values(), slim.state_dict().values()):
        assert torch.equal(a, b)
    slim.load_state_dict(small_cnn().state_dict())
    assert torch.equal(slim[0].weight, small_cnn()[0].weight)


def test_unsupported_reason_leaves_module_alone():
    class Odd(nn.Module):
        def __init__(self, ok):
            super().__init__()
            self.ok = ok

        def forward(self, x):
            return x

    @register(Odd)
    class SlimOdd(Odd):
        @classmethod
        def unsupported_reason(cls, module):
            return None if module.ok else "option ok=False is not supported"

    try:
        model = nn.Sequential(Odd(True), Odd(False))
        slim, report = slimgrad.convert(model, report=True)
        assert type(slim[0]) is SlimOdd and type(slim[1]) is Odd
        assert report.skipped[0].path == "1" and "ok=False" in report.skipped[0].reason
        assert "ok=False" in str(report)
    finally:
        del REPLACEMENTS[Odd], ORIGINALS[SlimOdd]


def test_register_rejects_non_subclasses_and_duplicates():
    with pytest.raises(TypeError, match="must subclass"):
        register(nn.Conv2d)(nn.Module)
    with pytest.raises(ValueError, match="already has a replacement"):
        register(nn.Conv2d)(type("Again", (nn.Conv2d,), {}))


def test_replacements_keep_the_stock_class_name_and_pickle():
    """Every replacement's ``type(m).__name__`` is stock's (tools find classes by name: accelerate's
    get_module_class_from_name for FSDP's wrap policy found LlamaRMSNorm before convert and nothing after, where
    torch.nn's kept theirs), and a converted model pickles (the class's qualified name is its own)."""
    import pickle

    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1)
    slim = slimgrad.convert(transformers.LlamaForCausalLM(config))
    from slimgrad._registry import ORIGINALS

    converted = [m for m in slim.modules() if type(m) in ORIGINALS]
    assert {type(m).__name__ for m in converted} >= {"LlamaRMSNorm", "LlamaMLP"}
    for m in converted:
        assert type(m).__name__ == ORIGINALS[type(m)].__name__
    again = pickle.loads(pickle.dumps(slim))
    assert [type(m) for m in again.modules()] == [type(m) for m in slim.modules()]


class _RebuiltOnCopy(nn.Module):
    """A model whose copy protocol builds a fresh module (torchvision's create_feature_extractor gives a
    DualGraphModule, whose deepcopy does this): the copy starts in train mode whatever the original's mode."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())

    def forward(self, x):
        return self.body(x)

    def __deepcopy__(self, memo):
        fresh = type(self)()
        fresh.load_state_dict(self.state_dict())
        return fresh


def test_convert_keeps_train_eval_flags_through_a_copy_that_rebuilds_the_model():
    torch.manual_seed(0)
    stock = _RebuiltOnCopy()
    with torch.no_grad():
        stock.body[1].running_mean.uniform_(-1, 1)
        stock.body[1].running_var.uniform_(0.5, 2)
    stock.eval()
    stock.body[0].train()  # a per-module mix is kept too
    converted = slimgrad.convert(stock)
    assert [m.training for m in converted.modules()] == [m.training for m in stock.modules()]
    x = torch.randn(2, 3, 8, 8)
    assert torch.equal(converted(x), stock(x))  # eval batch norm: running statistics, as stock's


def _slimgrad_warnings(record):
    return [str(w.message) for w in record if issubclass(w.category, slimgrad.SlimgradWarning)]


def test_a_copy_of_a_compiled_model_says_it_runs_eagerly():
    """torch's Module.__getstate__ drops Module.compile(): convert's default copy would run eagerly, silently."""
    from slimgrad import _notices

    _notices.reset_warned()
    model = small_cnn()
    model.compile()
    with pytest.warns(slimgrad.SlimgradWarning, match=r"does not copy Module.compile\(\)"):
        slim = slimgrad.convert(model)
    assert slim.__dict__.get("_compiled_call_impl") is None  # the fact the warning states
    _notices.reset_warned()
    import warnings

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        kept = slimgrad.convert(model, inplace=True)  # keeps the compiled call: nothing to say
    assert kept._compiled_call_impl is not None and not _slimgrad_warnings(record)


def test_an_optimizer_built_before_a_copying_convert_warns_at_its_empty_step():
    import warnings

    from slimgrad import _notices

    _notices.reset_warned()
    torch.manual_seed(0)
    model = small_cnn()
    early = torch.optim.SGD(model.parameters(), lr=0.1)
    slim = slimgrad.convert(model)
    late = torch.optim.SGD(slim.parameters(), lr=0.1)
    slim(torch.randn(2, 3, 8, 8)).sum().backward()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        late.step()  # the converted model's own parameters: nothing to say
        assert not _slimgrad_warnings(record)
        before = [p.detach().clone() for p in model.parameters()]
        early.step()
        early.step()  # once per optimizer
    said = _slimgrad_warnings(record)
    assert len(said) == 1 and "before slimgrad.convert" in said[0] and "inplace=True" in said[0]
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # what it warns of: nothing moved
    # an optimizer of the original that trains the original (a stock-versus-slimgrad comparison) is left alone
    stock_opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 3, 8, 8)).sum().backward()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        stock_opt.step()
    assert not _slimgrad_warnings(record)


def test_options_that_select_nothing_or_change_nothing_are_refused():
    """include=[] converted every module (the 'no filter' of None), and optimizer / loss_fn / hold_output without a
    budget were ignored while example without one raised (the errors sweep)."""
    model = small_cnn()
    with pytest.raises(ValueError, match="'include' is empty"):
        slimgrad.convert(model, include=[])
    for kwargs in ({"optimizer": "adamw"}, {"loss_fn": lambda out: out.sum()}, {"hold_output": True}):
        with pytest.raises(ValueError, match=f"'{next(iter(kwargs))}' is used with 'budget'"):
            slimgrad.convert(model, **kwargs)


def test_the_optimizer_warning_waits_for_a_closure_and_sees_zeroed_gradients():
    """LBFGS computes its gradients inside step(closure): it was warned of though its parameters move; an optimizer
    whose gradients zero_grad(set_to_none=False) left at zero before a copying convert trained nothing, unsaid
    (review sweep)."""
    import warnings

    from slimgrad import _notices

    _notices.reset_warned()
    torch.manual_seed(0)
    baseline = small_cnn()
    lbfgs = torch.optim.LBFGS(baseline.parameters(), max_iter=2)
    slimgrad.convert(copy.deepcopy(baseline))  # (a converted copy beside a stock baseline)
    slimgrad.convert(baseline)
    x = torch.randn(2, 3, 8, 8)

    def closure():
        lbfgs.zero_grad()
        loss = baseline(x).square().mean()
        loss.backward()
        return loss

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        lbfgs.step(closure)
    assert not _slimgrad_warnings(record)

    _notices.reset_warned()
    model = small_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(x).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=False)
    slim = slimgrad.convert(model)
    slim(x).sum().backward()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        opt.step()
    assert any("before slimgrad.convert" in m for m in _slimgrad_warnings(record))


def test_lazy_module_before_its_first_forward_is_left_alone_saying_why():
    """A lazy module's parameters do not exist before its first forward, where it turns into its plain class: the
    report said "subclass ... (it may compute something else)" or counted an unknown type (the wrappers sweep)."""
    model = nn.Sequential(nn.LazyConv2d(6, 3, padding=1), nn.LazyBatchNorm2d(), nn.ReLU(), nn.Flatten(),
                          nn.LazyLinear(5))
    model, report = slimgrad.convert(model, inplace=True, report=True)
    reasons = {s.path: s.reason for s in report.skipped}
    for path, becomes in (("0", "Conv2d"), ("1", "BatchNorm2d"), ("4", "Linear")):
        assert "lazy module" in reasons[path] and f"becomes a {becomes}" in reasons[path], reasons
        assert "run one forward" in reasons[path]
    assert not report.unknown
    model(torch.randn(2, 3, 8, 8))  # materialised: a second convert converts the plain classes
    model = slimgrad.convert(model)
    assert type(model[0]) is not nn.Conv2d and isinstance(model[0], nn.Conv2d)

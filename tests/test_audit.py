"""The audit: totals agree with an independent count, minima with hand-computed ones, CLI end to end."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from torch import nn

import slimgrad
from slimgrad.audit import AuditReport, audit, prepare
from slimgrad.measure import SavedTensors


def tiny():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(4, 4, 3, padding=1), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2),
    )


def independent_count(model, x):
    with SavedTensors(exclude=[model]) as counter:
        out = model(x)
    out.sum().backward()
    return counter.bytes


@pytest.mark.parametrize("case", ["all", "input", "input-bn-eval"])
def test_totals_equal_an_independent_saved_tensor_count(case):
    model = tiny()
    x = torch.randn(2, 3, 8, 8)
    report = audit(model, x, case=case, measure_peak=False)
    stock = slimgrad.revert(__import__("copy").deepcopy(model))
    needs_x = slimgrad.cases.apply_case(stock, case)
    assert report.stock_total == independent_count(stock, x.clone().requires_grad_(needs_x))
    slim = slimgrad.convert(stock)
    independent_count(slim, x.clone().requires_grad_(needs_x))  # warm-up, as the audit does
    assert report.slim_total == independent_count(slim, x.clone().requires_grad_(needs_x))
    assert report.slim_total <= report.stock_total
    # the user's model is untouched
    assert all(type(m).__module__.startswith("torch") for m in model.modules())


def test_peak_line_is_a_training_step_from_zero_grad():
    """The peak line is a step's as it runs after ``zero_grad()``, gradients allocated inside it: it was measured with
    the gradients of the copies' earlier runs alive (left out: half of an all-trainable step's peak; the figures
    sweep). It equals the estimate of that step."""
    model = tiny()
    x = torch.randn(2, 3, 8, 8)
    report = audit(model, x, case="all")
    stock = slimgrad.revert(__import__("copy").deepcopy(model))
    slimgrad.cases.apply_case(stock, "all")
    assert report.stock_peak == slimgrad.estimate(stock, x).step_peak_bytes


def test_exported_at_package_level():
    assert slimgrad.audit is audit and slimgrad.AuditReport is AuditReport


def test_minimum_matches_hand_computed_rules():
    model = tiny()
    x = torch.randn(2, 3, 8, 8)
    report = audit(model, x, case="input", measure_peak=False)  # everything frozen, input needs grad
    rows = {r.path: r for r in report.rows}
    assert rows["0"].min_bytes == 0  # frozen conv: nothing
    assert rows["1"].min_bytes == 2 * 4 * 8 * 8 * 4 + 2 * 4 * 4  # train BN, x needs grad: x + stats
    assert rows["2"].min_bytes == (2 * 4 * 8 * 8 + 7) // 8  # relu: one bit per element
    assert rows["3"].min_bytes == 2 * 4 * 4 * 4 * 1  # max pool: one byte per output element
    assert rows["5"].min_bytes == 0
    assert rows["7"].min_bytes == 0  # frozen linear
    report_all = audit(model, x, case="all", measure_peak=False)
    rows = {r.path: r for r in report_all.rows}
    assert rows["0"].min_bytes == 2 * 3 * 8 * 8 * 4  # trainable conv keeps its input
    assert rows["7"].min_bytes == 2 * 4 * 4


def test_minimum_total_counts_a_shared_input_once():
    class QKV(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            return self.q(x) + self.k(x) * self.v(x)

    x = torch.randn(5, 8)
    report = audit(QKV(), x, case="all", measure_peak=False)
    rows = {r.path: r for r in report.rows}
    # x belongs to the first layer that needs it, in every column; k and v need nothing more
    assert rows["q"].min_bytes == rows["q"].stock == 5 * 8 * 4
    assert rows["k"].min_bytes == rows["v"].min_bytes == 0
    # the container's own mul keeps k(x) and v(x): no rule there, so the minimum is what is kept
    assert not rows[""].rule and rows[""].min_bytes == rows[""].stock == 2 * 5 * 8 * 4
    assert report.min_total == 5 * 8 * 4 + 2 * 5 * 8 * 4 == report.stock_total


def test_a_relu_mask_is_free_when_the_next_layer_keeps_the_output():
    """The issue's first example: the minimum used to count a mask per ReLU on top of the conv inputs."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(),
                          nn.Conv2d(4, 4, 3, padding=1))
    x = torch.randn(2, 3, 8, 8)
    report = audit(model, x, case="all", measure_peak=False)
    rows = {r.path: r for r in report.rows}
    act = 2 * 4 * 8 * 8 * 4
    # each conv needs its input; the ReLUs' masks are y > 0 of those kept inputs
    assert [rows[p].min_bytes for p in "01234"] == [2 * 3 * 8 * 8 * 4, 0, act, 0, act]
    assert report.min_total == 2 * 3 * 8 * 8 * 4 + 2 * act <= report.slim_total <= report.stock_total
    frozen = audit(model, x, case="input", measure_peak=False)
    rows = {r.path: r for r in frozen.rows}
    assert rows["1"].min_bytes == rows["3"].min_bytes == 2 * 4 * 8 * 8 // 8  # nothing keeps x or y: one bit
    assert rows["0"].min_bytes == rows["2"].min_bytes == 0


def test_hidden_ctx_attribute_tensors_are_counted():
    class Stash(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.kept = x * 2  # hidden from saved-tensor hooks, like bitsandbytes' ctx.tensors
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            return g

    class Hider(nn.Module):
        def forward(self, x):
            return Stash.apply(x)

    model = nn.Sequential(nn.Linear(4, 4), Hider())
    report = audit(model, torch.randn(3, 4), case="all", measure_peak=False)
    rows = {r.path: r for r in report.rows}
    assert rows["1"].stock_hidden_bytes == 3 * 4 * 4
    assert report.stock_hidden_total == 3 * 4 * 4


def test_storages_never_unpacked_are_flagged():
    class KeepsButNeverReads(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x * 3)  # kept for backward...
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2  # ...but never unpacked

    class Wasteful(nn.Module):
        def forward(self, x):
            return KeepsButNeverReads.apply(x)

    model = nn.Sequential(nn.Linear(4, 4), Wasteful())
    report = audit(model, torch.randn(3, 4), case="all", measure_peak=False)
    rows = {r.path: r for r in report.rows}
    assert rows["1"].stock_unread_bytes == 3 * 4 * 4
    assert rows["0"].stock_unread_bytes == 0  # Linear's kept input is read by its backward
    assert "never unpacks" in report.table()


def test_json_round_trip_table_and_png(tmp_path):
    report = audit(tiny(), torch.randn(2, 3, 8, 8), case="input-bn-eval")
    again = AuditReport.from_json(report.to_json())
    assert again == report
    assert json.loads(report.to_json())["case"] == "input-bn-eval"
    text = report.table()
    assert "total" in text and "BatchNorm2d" in text
    assert report.stock_peak > 0 and report.slim_peak > 0
    path = tmp_path / "audit.png"
    report.plot(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _cli(*args, env=None):
    """``python -m slimgrad ...`` on this checkout's slimgrad (its source directory first on the path, ahead of
    any PYTHONPATH a test adds for its own modules)."""
    env = dict(env if env is not None else os.environ)
    src = os.path.dirname(os.path.dirname(slimgrad.__file__))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-m", "slimgrad", *args], capture_output=True, text=True, env=env)


def _one_line_error(result, *needles):
    errors = [line for line in result.stderr.splitlines() if not line.startswith("[")]
    assert result.returncode == 2, result.stderr
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
    for needle in needles:
        assert needle in errors[0], errors[0]


def test_cli_runs_end_to_end(tmp_path):
    out = tmp_path / "a.png"
    js = tmp_path / "a.json"
    result = _cli("audit", "--model", "resnet18", "--case", "input-bn-eval", "--batch-size", "1",
                  "--image-size", "32", "--plot", str(out), "--json", str(js))
    assert result.returncode == 0, result.stderr
    assert "total" in result.stdout and out.read_bytes()[:4] == b"\x89PNG"
    assert AuditReport.from_json(js.read_text()).case == "input-bn-eval"
    assert "[3/3" in result.stderr  # progress


@pytest.mark.slow
def test_cli_lora_case_on_a_hugging_face_model():
    pytest.importorskip("peft")
    result = _cli("audit", "--hf", "llama", "--case", "lora", "--batch-size", "1", "--seq-len", "16", "--quiet")
    assert result.returncode == 0, result.stderr
    assert "lora_A" in result.stdout or "LlamaMLP" in result.stdout or "total" in result.stdout


def test_lora_case_freezes_the_base_and_trains_adapters():
    pytest.importorskip("peft")
    model = tiny()
    report = audit(model, torch.randn(2, 3, 8, 8), case="lora", measure_peak=False)
    lora = [r for r in report.rows if r.type_name.startswith("peft.tuners.lora.layer.")]
    # one row per LoRA layer (base and adapters together): frozen base + trainable adapters = mixed
    assert {r.type_name.rsplit(".", 1)[1] for r in lora} == {"Conv2d", "Linear"}
    assert all(r.params == "mixed" and r.rule for r in lora)
    assert not [r for r in report.rows if "lora_A" in r.path or r.path.endswith("base_layer")]
    stock, _, _ = prepare(model, "lora")
    assert all(p.requires_grad == ("lora_" in n) for n, p in stock.named_parameters())
    with pytest.raises(ValueError, match="unknown case 'nope'"):
        audit(model, torch.randn(2, 3, 8, 8), case="nope")


def test_cli_errors_are_one_line(tmp_path):
    _one_line_error(_cli("audit", "--factory", "no_such_module_xyz:build"), "no_such_module_xyz")
    _one_line_error(_cli("audit", "--factory", "json:loads"), "raised TypeError")
    _one_line_error(_cli("audit", "--factory", "json"), "module:function")
    (tmp_path / "user_models.py").write_text(
        "import torch\n"
        "def wrong_shape():\n"
        "    return torch.nn.Conv2d(3, 4, 3), torch.randn(2, 5, 8, 8)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    _one_line_error(_cli("audit", "--factory", "user_models:wrong_shape", env=env), "could not run")
    _one_line_error(_cli("audit", "--model", "nope"), "invalid choice")
    _one_line_error(_cli("audit", "--batch-size", "0"), "--batch-size")


# -- models as users bring them: outputs, keyword inputs, losses -------------------------------------------


class _Outputs(nn.Module):
    """A model whose output container is chosen by the test: dict, tuple, dataclass; keyword inputs."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x, *, scale=1.0, mask=None):
        h = self.a(x) * scale
        if mask is not None:
            h = h * mask
        y = self.b(h)
        if self.kind == "dict":
            return {"hidden": h, "logits": y, "count": torch.tensor(3)}
        if self.kind == "tuple":
            return h, (y, None)
        if self.kind == "dataclass":
            return _Out(y, h)
        return y


@__import__("dataclasses").dataclass
class _Out:
    logits: torch.Tensor
    hidden: torch.Tensor


@pytest.mark.parametrize("kind", ["dict", "tuple", "dataclass", "tensor"])
def test_any_output_container_and_keyword_inputs(kind):
    torch.manual_seed(0)
    x = torch.randn(3, 4)
    mask = torch.ones(3, 4)
    report = audit(_Outputs(kind), x, case="all", measure_peak=False, scale=2.0, mask=mask)
    rows = {r.path: r for r in report.rows}
    assert rows["a"].stock == rows["a"].min_bytes == 3 * 4 * 4  # a's input
    assert rows["b"].min_bytes == 3 * 4 * 4  # b's input, h * mask
    # mul by the mask keeps the mask... a keyword input, counted where the container keeps it
    assert report.stock_total == independent_count_kw(_Outputs(kind), x, scale=2.0, mask=mask)


def independent_count_kw(model, *args, **kwargs):
    from slimgrad.audit import default_loss

    with SavedTensors(exclude=[model]) as counter:
        out = model(*args, **kwargs)
    default_loss(out).backward()
    return counter.bytes


def test_default_loss_prefers_loss_and_sums_every_output_tensor():
    from slimgrad.audit import default_loss

    a = torch.ones(2, 3, requires_grad=True)
    b = torch.full((4,), 2.0, requires_grad=True)
    assert default_loss({"loss": (a * 5).sum(), "logits": a}).item() == 30
    assert default_loss({"hidden": a, "pooled": b, "ids": torch.arange(3)}).item() == 6 + 8
    assert default_loss((a, [b, None])).item() == 14
    assert default_loss(_Out(a, b)).item() == 14
    with pytest.raises(ValueError, match="requires grad"):
        default_loss({"ids": torch.arange(3), "frozen": torch.ones(2)})


def test_loss_fn_and_bad_arguments():
    model = tiny()
    x = torch.randn(2, 3, 8, 8)
    first_only = audit(model, x, case="all", measure_peak=False, loss_fn=lambda out: out[:, 0].sum())
    assert first_only.stock_total == audit(model, x, case="all", measure_peak=False).stock_total
    with pytest.raises(TypeError, match="'loss_fn' must be a callable"):
        audit(model, x, loss_fn=3)
    with pytest.raises(ValueError, match="one-element tensor"):
        audit(model, x, case="all", loss_fn=lambda out: out)
    with pytest.raises(ValueError, match="give the model's inputs"):
        audit(model)
    with pytest.raises(TypeError, match="'model' must be a torch.nn.Module"):
        audit(lambda x: x, x)


def test_hugging_face_model_outputs_and_keyword_inputs():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                  vocab_size=50, max_position_embeddings=16)
    torch.manual_seed(0)
    bert = transformers.BertModel(cfg)
    ids = torch.randint(0, 50, (2, 6))
    positional = audit(bert, ids, case="all", measure_peak=False)  # BaseModelOutputWithPooling...: no .loss
    keyword = audit(bert, input_ids=ids, attention_mask=torch.ones_like(ids), case="all", measure_peak=False)
    assert positional.stock_total > 0 and keyword.stock_total >= positional.stock_total
    with pytest.raises(ValueError, match="inputs_embeds"):
        audit(bert, ids, case="input")  # token ids cannot need a gradient: say what to pass instead
    embeds = audit(bert, inputs_embeds=torch.randn(2, 6, 32), case="input", measure_peak=False)
    assert 0 < embeds.min_total <= embeds.slim_total <= embeds.stock_total


def test_llama_norm_case_and_the_lora_minimum_in_bf16():
    """The issue's failures: 'norm' on a Llama found no norm; T5 bf16 + LoRA had minimum > slimgrad."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("peft")
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, vocab_size=50)
    torch.manual_seed(0)
    ids = torch.randint(0, 50, (2, 6))
    norm = audit(transformers.LlamaForCausalLM(cfg), input_ids=ids, labels=ids, case="norm", measure_peak=False)
    norms = [r for r in norm.rows if r.type_name.endswith("LlamaRMSNorm")]
    assert norms and all(r.params == "trainable" and r.rule for r in norms)
    cfg = transformers.T5Config(d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=16, vocab_size=50,
                                decoder_start_token_id=0)
    t5 = transformers.T5ForConditionalGeneration(cfg).to(torch.bfloat16)
    report = audit(t5, input_ids=ids, labels=ids, case="lora", measure_peak=False)
    lora = [r for r in report.rows if r.type_name == "peft.tuners.lora.layer.Linear"]
    assert lora and all(r.min_bytes <= r.slim <= r.stock for r in lora)
    # every LoRA layer's bytes are on its own row (none left on lora_A / lora_B rows)
    assert not [r for r in report.rows if ".lora_" in r.path and (r.stock or r.slim or r.min_bytes)]
    assert report.min_total <= report.slim_total <= report.stock_total


# -- the table ----------------------------------------------------------------------------------------------


def test_table_shows_whole_paths_wrapping_long_ones():
    def nest(depth):
        return nn.Linear(4, 4) if depth == 0 else nn.Sequential(nest(depth - 1))

    class Named(nn.Module):
        def __init__(self):
            super().__init__()
            self.a_rather_long_module_name = nest(12)

        def forward(self, x):
            return self.a_rather_long_module_name(x)

    deep = nn.Sequential(Named(), nn.ReLU(), nn.Linear(4, 4))
    report = audit(deep, torch.randn(2, 4), case="all", measure_peak=False)
    text = report.table(path_width=30)
    long_path = "0.a_rather_long_module_name" + ".0" * 12
    assert long_path in text.splitlines()  # on a line of its own: whole, never cut
    assert "2  " in text and "Linear" in text
    short = report.table()
    assert any(line.startswith(long_path + " ") for line in short.splitlines())


def test_table_prints_a_shared_prefix_once():
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)))
    report = audit(model, torch.randn(2, 4), case="all", measure_peak=False)
    lines = report.table().splitlines()
    assert "module paths below start with '0.'" in lines
    assert any(line.startswith("0  ") or line.startswith("0 ") for line in lines)
    assert any(line.startswith("2 ") for line in lines)


# -- conversion report coverage --------------------------------------------------------------------------------


def test_conversion_report_lists_unknown_types_by_count_with_qualified_names(caplog):
    import logging

    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ELU(), nn.Conv2d(4, 4, 3), nn.ELU(), nn.Softplus(),
                          nn.Sequential(nn.Linear(4, 4)))
    with caplog.at_level(logging.INFO, logger="slimgrad"):
        _, rep = slimgrad.convert(model, report=True)
    assert rep.unknown == {"ELU": 2, "Softplus": 1}  # pure containers (Sequential) are not listed
    assert rep.converted_types == {"Conv2d": 2}
    assert rep.stock_minimal == {"Linear": 1}
    assert "not known (run as stock): ELU ×2, Softplus ×1" in str(rep)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    peft = pytest.importorskip("peft")
    lora = peft.get_peft_model(nn.Sequential(nn.Linear(4, 4)), peft.LoraConfig(r=2, target_modules=["0"]))
    _, rep = slimgrad.convert(lora, report=True)
    assert rep.converted_types.get("peft.tuners.lora.layer.Linear") == 1
    assert "peft.tuners.lora.layer.Linear ×1" in str(rep)
    assert "ParameterDict" not in rep.unknown and "ParameterDict" not in str(rep)  # peft's containers: no forward
    activations = pytest.importorskip("diffusers.models.activations")
    _, rep = slimgrad.convert(activations.GELU(4, 8), report=True)
    assert rep.stock_minimal == {"diffusers.models.activations.GELU": 1, "Linear": 1} and not rep.unknown, rep


# -- the command line ---------------------------------------------------------------------------------------


def test_cli_factory_with_keyword_inputs(tmp_path):
    (tmp_path / "kw_models.py").write_text(
        "import torch\n"
        "class M(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.lin = torch.nn.Linear(4, 4)\n"
        "    def forward(self, x, *, scale):\n"
        "        return self.lin(x) * scale\n"
        "def build():\n"
        "    return M(), {'x': torch.randn(2, 4), 'scale': torch.tensor(2.0)}\n"
        "def build_both():\n"
        "    return M(), (torch.randn(2, 4),), {'scale': 3.0}\n"
    )
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    for name in ("build", "build_both"):
        result = _cli("audit", "--factory", f"kw_models:{name}", "--quiet", env=env)
        assert result.returncode == 0, result.stderr
        assert "lin" in result.stdout and "total" in result.stdout


def _main(*args, capsys):
    """``python -m slimgrad ...`` in this process (a subprocess per bad input costs a torch import each):
    the exit code, and stderr's lines. A traceback would escape main() and fail the test."""
    from slimgrad.cli import main

    try:
        code = main(list(args))
    except SystemExit as e:  # argparse
        code = e.code
    return code, capsys.readouterr().err


def _one_line_main(*args, capsys, needle):
    code, err = _main(*args, capsys=capsys)
    errors = [line for line in err.splitlines() if not line.startswith("[")]
    assert code == 2, err
    assert len(errors) == 1 and needle in errors[0], err


def test_cli_bad_inputs_end_in_one_line_with_code_2(tmp_path, monkeypatch, capsys):
    (tmp_path / "bad_models.py").write_text(
        "import torch\n"
        "def nothing():\n"
        "    return None\n"
        "def not_a_model():\n"
        "    return 'model', torch.randn(2)\n"
        "def crashes_in_forward():\n"
        "    class M(torch.nn.Module):\n"
        "        def forward(self, x):\n"
        "            raise KeyError('oops')\n"
        "    return M(), torch.randn(2)\n"
        "def int_input():\n"
        "    return torch.nn.Embedding(5, 3), torch.tensor([1, 2])\n"
        "def no_norm():\n"
        "    return torch.nn.Linear(3, 3), torch.randn(2, 3)\n"
        "VALUE = 3\n"
    )
    (tmp_path / "broken_module.py").write_text("raise RuntimeError('cannot import me')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    _one_line_main("demo", "--batch-size", "1", capsys=capsys, needle="--batch-size must be >= 2")
    _one_line_main("audit", "--case", "all", "--batch-size", "1", capsys=capsys, needle="--batch-size must be >= 2")
    _one_line_main("audit", "--factory", "bad_models:nothing", capsys=capsys, needle="--factory must return")
    _one_line_main("audit", "--factory", "bad_models:not_a_model", capsys=capsys, needle="--factory must return")
    _one_line_main("audit", "--factory", "bad_models:crashes_in_forward", capsys=capsys, needle="KeyError")
    _one_line_main("audit", "--factory", "bad_models:int_input", "--case", "input", capsys=capsys,
                   needle="floating-point input")
    _one_line_main("audit", "--factory", "bad_models:no_norm", "--case", "norm", capsys=capsys,
                   needle="no normalisation layer")
    _one_line_main("audit", "--factory", "bad_models:VALUE", capsys=capsys, needle="not a function")
    _one_line_main("audit", "--factory", "bad_models:missing", capsys=capsys, needle="AttributeError")
    _one_line_main("audit", "--factory", "broken_module:x", capsys=capsys, needle="cannot import me")
    _one_line_main("audit", "--json", str(tmp_path / "no" / "dir.json"), capsys=capsys, needle="does not exist")
    _one_line_main("audit", "--plot", str(tmp_path), capsys=capsys, needle="is a directory")
    _one_line_main("audit", "--seq-len", "0", capsys=capsys, needle="--seq-len")
    _one_line_main("audit", "--case", "nope", capsys=capsys, needle="invalid choice")
    _one_line_main("audit", "--hf", "nope", capsys=capsys, needle="invalid choice")
    _one_line_main("audit", "--dtype", "int8", capsys=capsys, needle="invalid choice")
    _one_line_main("audit", "--model", "vgg11", "--hf", "bert", capsys=capsys, needle="not allowed with")
    _one_line_main("audit", "--batch-size", "x", capsys=capsys, needle="invalid int value")
    _one_line_main("nope", capsys=capsys, needle="invalid choice")


@pytest.mark.slow
def test_cli_hugging_face_models_run(tmp_path):
    pytest.importorskip("transformers")
    for name in ("bert", "t5"):
        result = _cli("audit", "--hf", name, "--batch-size", "1", "--seq-len", "8", "--quiet",
                      "--plot", str(tmp_path / f"{name}.png"))
        assert result.returncode == 0, result.stderr
        assert "total" in result.stdout and (tmp_path / f"{name}.png").read_bytes()[:4] == b"\x89PNG"


# -- composite rules, values written out from shapes ---------------------------------------------------------


def test_lora_rule_in_bf16_counts_x_once_in_its_own_dtype():
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 8)).to(torch.bfloat16)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["0", "1"], lora_dropout=0.1))
    model.train()
    x = torch.randn(6, 16, dtype=torch.bfloat16)
    report = audit(model, x, measure_peak=False)  # as given: adapters (fp32, peft's default) train
    rows = {r.path.rsplit(".", 1)[-1]: r for r in report.rows if r.rule}
    # x once in bf16, A(x) 6x4 fp32, a seed; never peft's fp32 copy of x or its dropped copy
    assert rows["0"].min_bytes == 6 * 16 * 2 + 6 * 4 * 4 + 8
    assert rows["1"].min_bytes == 6 * 16 * 2 + 6 * 4 * 4 + 8  # its input is layer 0's output
    assert all(r.min_bytes <= r.slim <= r.stock for r in rows.values())


def test_gated_mlp_rule_recomputes_the_product():
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaMLP

    cfg = transformers.LlamaConfig(hidden_size=8, intermediate_size=24, num_attention_heads=2, num_key_value_heads=2)
    torch.manual_seed(0)
    mlp = nn.Sequential(LlamaMLP(cfg))
    x = torch.randn(2, 5, 8)
    rows = {r.path: r for r in audit(mlp, x, case="all", measure_peak=False).rows}
    inner = 2 * 5 * 24 * 4
    assert rows["0"].min_bytes == 2 * 5 * 8 * 4 + 2 * inner  # x, gate, up; down's input = act(gate) * up
    assert rows["0"].todo == rows["0"].slim - rows["0"].min_bytes
    rows = {r.path: r for r in audit(mlp, x, case="input", measure_peak=False).rows}
    assert rows["0"].min_bytes == 2 * inner  # frozen: gate and up for dX, no x


def test_meta_device_audits_from_shapes_without_a_peak():
    # a model built under torch.device("meta") had every column 0: meta storages all share address 0, the
    # parameters' included, so every saved tensor was taken for a parameter
    x = torch.randn(2, 3, 8, 8)
    on_cpu = audit(tiny(), x, case="all")
    with torch.device("meta"):
        on_meta_model = tiny()
    on_meta = audit(on_meta_model, x.to("meta"), case="all")
    assert on_meta.stock_total > 0 and on_meta.stock_total == on_cpu.stock_total
    assert (on_meta.min_total, on_meta.slim_total) == (on_cpu.min_total, on_cpu.slim_total)
    rows = lambda r: [(row.path, row.stock_bytes, row.min_bytes, row.slim_bytes) for row in r.rows]  # noqa: E731
    assert rows(on_meta) == rows(on_cpu)
    assert on_meta.stock_peak is None and on_meta.slim_peak is None and on_cpu.stock_peak > 0
    assert re.search(r"peak over forward\+backward +- +-\n", on_meta.table())


def test_lora_case_on_a_model_with_adapters_audits_its_own():
    """case='lora' on a model that already has peft adapters (a PeftModel: what a user audits) keeps its adapters;
    it wrapped the model in peft a second time (a second adapter, rows under base_model.model.base_model...)."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, vocab_size=50)
    torch.manual_seed(0)
    model = peft.get_peft_model(transformers.LlamaForCausalLM(cfg),
                                peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    ids = torch.randint(0, 50, (2, 6))
    report = audit(model, input_ids=ids, labels=ids, case="lora", measure_peak=False)
    lora = [r for r in report.rows if r.type_name == "peft.tuners.lora.layer.Linear"]
    assert len(lora) == 2 and not [r for r in report.rows if "base_model.model.base_model" in r.path]
    assert sum(".lora_A." in n for n, _ in model.named_modules()) == 2  # the user's model untouched

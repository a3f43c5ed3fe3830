"""The audit: totals agree with an independent count, minima with hand-computed ones, CLI end to end."""

import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import slimgrad
from slimgrad.audit import AuditReport, audit
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
    params = {r.path: r.params for r in report.rows}
    assert any("lora_A" in p and v == "trainable" for p, v in params.items())
    assert any(p.endswith("base_layer") and v == "frozen" for p, v in params.items())
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
    bad_model = _cli("audit", "--model", "nope")
    assert bad_model.returncode == 2 and "invalid choice" in bad_model.stderr
    bad_size = _cli("audit", "--batch-size", "0")
    assert bad_size.returncode == 2 and "--batch-size" in bad_size.stderr

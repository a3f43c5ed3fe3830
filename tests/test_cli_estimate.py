"""``python -m slimgrad estimate``: what it prints is what slimgrad.estimate / slimgrad.plan return on the same
model, and a mistake ends in one line on stderr with exit code 2."""

import copy
import json
import subprocess
import sys
import textwrap

import pytest
import torch

import slimgrad
from slimgrad import cli

FACTORY = textwrap.dedent('''
    import torch
    from torch import nn


    def build():
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Dropout(0.1)) for _ in range(6)],
                             nn.Linear(64, 1))


    def tiny():
        return build(), torch.randn(256, 64, generator=torch.Generator().manual_seed(1))


    def broken():
        raise RuntimeError("no weights here")


    def both():
        return build(), (torch.randn(4, 64),), {"unused": torch.randn(1)}
''')


@pytest.fixture
def factory(tmp_path, monkeypatch):
    (tmp_path / "cli_estimate_factory.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("cli_estimate_factory", None)
    import cli_estimate_factory

    return cli_estimate_factory


def _run(capsys, *argv):
    code = cli.main(["estimate", *argv, "--quiet"])
    out, err = capsys.readouterr()
    return code, out, err


def _expected(factory, *, optimizer=None, converted=True):
    model, x = factory.tiny()
    model.train()
    if converted:
        model = slimgrad.convert(model)
    return model, x, slimgrad.estimate(copy.deepcopy(model), x, optimizer=optimizer)


def test_default_prints_stock_and_converted_side_by_side(factory, capsys):
    code, out, err = _run(capsys, "--factory", "cli_estimate_factory:tiny", "--optimizer", "adamw")
    assert code == 0 and err == ""
    _, _, stock = _expected(factory, optimizer="adamw", converted=False)
    _, _, slim = _expected(factory, optimizer="adamw")
    assert stock.kept_bytes > slim.kept_bytes  # the comparison shows something
    assert "stock PyTorch:\n" + str(stock) + "\n" in out
    assert "slimgrad.convert:\n" + str(slim) + "\n" in out
    table = out.split("\n\n")[0].splitlines()
    assert table[0].startswith("one training step (forward, loss, backward, optimizer step), optimizer adamw")
    assert table[1].split() == ["MiB", "stock", "slimgrad"]
    kept = next(line for line in table if line.startswith("kept for backward")).split()[-2:]
    assert kept == [f"{stock.kept_bytes / 2**20:.2f}", f"{slim.kept_bytes / 2**20:.2f}"]


@pytest.mark.parametrize("flag, shown, hidden", [("--convert", "slimgrad.convert:", "stock PyTorch:"),
                                                  ("--stock", "stock PyTorch:", "slimgrad.convert:")])
def test_convert_or_stock_alone(factory, capsys, flag, shown, hidden):
    code, out, _ = _run(capsys, "--factory", "cli_estimate_factory:tiny", flag)
    assert code == 0 and shown in out and hidden not in out
    _, _, expected = _expected(factory, converted=flag == "--convert")
    assert str(expected) in out


def test_budget_prints_the_plan_and_writes_json_and_plot(factory, capsys, tmp_path):
    model, x, est = _expected(factory)
    full = slimgrad.plan(model, 1, x)
    budget = (full.peak_before + full.smallest_feasible) // 2
    chosen = slimgrad.plan(model, budget, x)
    assert chosen.fits and chosen.actions
    argv = ["--factory", "cli_estimate_factory:tiny", "--budget", str(budget), "--json", str(tmp_path / "e.json")]
    plot = pytest.importorskip("matplotlib", reason="--plot needs matplotlib") and tmp_path / "plan.png"
    code, out, _ = _run(capsys, *argv, "--plot", str(plot))
    assert code == 0
    printed = out.split("memory plan for the converted model:\n")[1].splitlines()
    assert printed[0].startswith(f"slimgrad.plan: budget {budget / 2**20:.1f} MiB on cpu: peak "
                                 f"{full.peak_before / 2**20:.1f} MiB -> ") and ", fits; about +" in printed[0]
    rows = {r.split()[0]: r.split()[1] for r in printed[2:] if r.startswith("  ") and "note:" not in r}
    assert set(rows) == {str(i) for i in range(6)}  # the head (one Linear) is no block
    # which of the equal blocks are checkpointed, and so how many, follows measured times (noisy)
    data = json.loads((tmp_path / "e.json").read_text())
    assert set(data) == {"stock", "slimgrad", "plan"}
    assert data["slimgrad"]["peak_bytes"] == est.peak_bytes and data["slimgrad"]["kept_bytes"] == est.kept_bytes
    assert data["plan"]["actions"] == {p: a for p, a in rows.items() if a != "keep"}
    assert data["plan"]["fits"] is True and data["plan"]["peak_after"] <= budget
    # (a plan that fits reports the lowest peak it tried; a refusal searches for the lowest a plan reaches)
    assert data["plan"]["budget"] == budget and data["plan"]["smallest_feasible"] >= full.smallest_feasible
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_budget_no_plan_meets_exits_1_and_says_so(factory, capsys):
    code, out, err = _run(capsys, "--factory", "cli_estimate_factory:tiny", "--convert", "--budget", "1KiB")
    assert code == 1 and err == ""
    assert "does NOT fit" in out and "the smallest budget any plan meets is" in out


@pytest.mark.slow
def test_hf_llama_bf16_with_adamw_and_chunked_loss(capsys, tmp_path):
    pytest.importorskip("transformers")
    argv = ["--hf", "llama", "--dtype", "bfloat16", "--seq-len", "256", "--batch-size", "4", "--optimizer", "adamw",
            "--convert"]
    code, out, _ = _run(capsys, *argv, "--json", str(tmp_path / "plain.json"))
    assert code == 0
    assert "slimgrad.estimate: peak" in out and "model.layers.0" in out and "model.layers.1" in out
    code, out, _ = _run(capsys, *argv, "--chunked-loss", "--json", str(tmp_path / "chunked.json"))
    assert code == 0
    plain, chunked = (json.loads((tmp_path / f).read_text())["slimgrad"] for f in ("plain.json", "chunked.json"))
    assert chunked["peak_bytes"] < plain["peak_bytes"]  # the full logits and their gradient are gone


@pytest.mark.parametrize("argv, message", [
    (["--plot", "p.png"], "slimgrad: error: --plot draws the memory plan: give --budget too"),
    (["--budget", "twelve"], "slimgrad: error: --budget: expected a positive number of bytes"),
    (["--budget", "0GiB"], "slimgrad: error: --budget: expected a positive number of bytes"),
    (["--json", "/nonexistent-dir/e.json"], "slimgrad: error: --json '/nonexistent-dir/e.json': directory"),
])
def test_argument_errors_are_one_line_exit_2(factory, capsys, argv, message):
    code, out, err = _run(capsys, "--factory", "cli_estimate_factory:tiny", *argv)
    assert code == 2 and out == ""
    assert err.startswith(message) and err.count("\n") == 1, err


@pytest.mark.parametrize("name, message", [
    ("broken", "--factory 'cli_estimate_factory:broken' raised RuntimeError: no weights here"),
    ("both", "--budget plans for one batch"),
])
def test_factory_errors_are_one_line_exit_2(factory, capsys, name, message):
    code, out, err = _run(capsys, "--factory", f"cli_estimate_factory:{name}", "--budget", "1GiB")
    assert code == 2 and err.startswith(f"slimgrad: error: {message}") and err.count("\n") == 1, err


def test_model_failing_on_its_input_is_one_line(capsys, factory, monkeypatch):
    monkeypatch.setattr(factory, "tiny", lambda: (factory.build(), torch.randn(4, 3)))
    code, _, err = _run(capsys, "--factory", "cli_estimate_factory:tiny")
    assert code == 2 and err.startswith("slimgrad: error: the model could not run on the example input: ")
    assert err.count("\n") == 1


@pytest.mark.parametrize("argv", [["--optimizer", "lamb"], ["--convert", "--stock"], ["--batch-size", "1"]])
def test_bad_command_lines_exit_2(capsys, argv):
    with pytest.raises(SystemExit) as e:
        cli.main(["estimate", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("slimgrad: error: ") and err.count("\n") == 1


def test_python_dash_m_entry_point(tmp_path):
    """The real command line: `python -m slimgrad estimate ...` (an error, so it ends before any simulation)."""
    result = subprocess.run([sys.executable, "-m", "slimgrad", "estimate", "--model", "resnet18", "--plot",
                             str(tmp_path / "p.png")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip().splitlines()[-1].startswith("slimgrad: error: --plot draws the memory plan")


def test_hf_without_transformers_names_the_extra_to_install(capsys, monkeypatch):
    """The hint names what a user of the released package can run: the `hf` extra (it named a constraints file the
    wheel does not ship: pkg44)."""
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    code, _, err = _run(capsys, "--hf", "llama")
    assert code == 2 and "pip install 'slimgrad[hf]'" in err and "constraints" not in err, err

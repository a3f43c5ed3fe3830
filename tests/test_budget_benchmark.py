"""benchmarks/budget.py (the plan against the alternatives users pick for a memory budget) runs end to end on
tiny sizes and prints its tables with measured figures, so the published docs/budget.md can be re-made."""

import pathlib
import re
import sys

import pytest

import slimgrad

pytest.importorskip("peft")
pytest.importorskip("transformers")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))


@pytest.fixture
def _process_state_restored():
    """budget.main is a script: it quiets the slimgrad logger and pins one thread for the whole process."""
    import logging

    import torch

    level, threads = logging.getLogger("slimgrad").level, torch.get_num_threads()
    yield
    logging.getLogger("slimgrad").setLevel(level)
    torch.set_num_threads(threads)


@pytest.mark.slow
def test_budget_quick_prints_every_table(capsys, tmp_path, _process_state_restored):
    pytest.importorskip("bitsandbytes")
    import budget

    out = tmp_path / "budget.md"
    text = budget.main(["--quick", "--write", "--out", str(out)])
    assert capsys.readouterr().out.strip() == text.strip()
    assert out.read_text() == text  # --out: a GPU run writes its own file, not docs/budget.md
    for title in ("### Llama-like bf16", "### Llama-like QLoRA", "### ResNet-18"):
        assert title in text
        section = text[text.index(title):]
        section = section[:section.index("Target:")]
        rows = [line for line in section.splitlines() if line.startswith("| (")]
        labels = [row.split("|")[1].strip() for row in rows[:6]]
        assert labels == [label for key, label in budget.ALTERNATIVES if key != "stock"]
        for row in rows:  # every alternative ran on the 4-bit model too (or says why not), none failed
            assert "error" not in row, row
        plan_row = rows[5]
        # the plan's cells are measured: a batch size (or "none") and a time or a reason
        assert re.search(r"\| (\d+|none) \|", plan_row)
    assert "n/a on CPU" in text  # offloaded checkpointing has nothing to offload to on CPU


@pytest.mark.parametrize("key", ["llama", "qlora", "cnn"])
def test_every_alternative_steps_with_stocks_gradients(key, monkeypatch):
    """Each alternative's model, offloaded checkpointing included (the table runs it on CUDA only, so this is its
    only run here), steps on CPU and gives stock's gradients: the table compares like with like."""
    if key == "qlora":
        pytest.importorskip("bitsandbytes")
    import budget
    import torch
    import transformers.modeling_utils

    # transformers' offload asks for pinned host memory, which a CPU-only torch refuses: the same hooks, unpinned
    unpinned = transformers.modeling_utils.save_on_cpu
    monkeypatch.setattr(transformers.modeling_utils, "save_on_cpu",
                        lambda pin_memory=False, **kw: unpinned(pin_memory=torch.cuda.is_available(), **kw))

    work = {"llama": budget.Llama, "qlora": budget.QLoRA, "cnn": budget.ResNet}[key](True)
    bench = budget.Bench(work, torch.device("cpu"), compile_ok=False, log=print)
    batch = work.batch(2, bench.device)

    def grads(m):
        m.zero_grad(set_to_none=True)
        torch.manual_seed(3)  # LoRA dropout: the same draws in every model
        work.step(m, batch)
        g = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
        m.zero_grad(set_to_none=True)
        return g

    stock, slim = grads(bench.model("stock", 0, 1.0, 2)), grads(bench.model("slim", 0, 1.0, 2))
    assert stock and slim.keys() == stock.keys()
    # slimgrad alone against stock: the same step, not bitwise on these models (bf16 compute in the Llamas: up to
    # ~1 % of a LoRA gradient's largest entry, measured); within 2**-5 of it (bf16 has 8 bits), 1e-5 in fp32
    scale = 2**-5 if key in ("llama", "qlora") else 1e-5
    for n in stock:
        assert (slim[n] - stock[n]).abs().max() <= scale * stock[n].abs().max(), n
    # recompute and offload change where tensors live, never the numbers: bitwise the run they wrap
    for alt, reference in (("ckpt", stock), ("offload", stock), ("slim+ckpt", slim)):
        got = grads(bench.model(alt, 0, 1.0, 2))
        assert got.keys() == reference.keys(), alt
        for n in reference:
            assert torch.equal(got[n], reference[n]), (alt, n)
    # the plan budgets the step plus what exists before it, counted as the estimate counts it (a 4-bit weight's
    # quantization state included)
    m = bench.model("stock", 0, 1.0, 2)
    e = slimgrad.estimate(m, **batch) if isinstance(batch, dict) else slimgrad.estimate(m, batch)
    assert e.peak_bytes - e.step_peak_bytes == budget._before_step_bytes(m, batch)


def test_largest_search_finds_the_boundary_of_a_step_function():
    """The search (linear guess, gallop, bisection) returns the largest size under the budget for a peak that
    is not linear in the size, and 0 when size 1 is already over."""
    import budget

    class Fake(budget.Bench):
        def __init__(self, peaks):
            self.work = budget.Workload()
            self.work.ref, self.work.cap = 8, 256
            self.peaks = peaks

        def peak(self, alt, b, fraction, n):
            return self.peaks(n)

    for bound in (1, 3, 7, 8, 9, 40, 255):
        runs = []
        found = Fake(lambda n: 1000 + 10 * n * n).largest("x", 1000 + 10 * bound * bound, 0.5, runs)
        assert found == bound
    assert Fake(lambda n: 10**9).largest("x", 100, 0.5, []) == 0
    assert Fake(lambda n: n).largest("x", 10**9, 0.5, []) == 256


def test_estimate_cost_prints_its_table(capsys, _process_state_restored):
    """benchmarks/estimate_cost.py (the wall time of estimate and plan by depth) runs and prints one row per depth;
    bad depths are refused naming the option."""
    import estimate_cost

    text = estimate_cost.main(["--layers", "1,2", "--no-7b"])
    rows = [line for line in text.splitlines() if re.match(r"\| \d+ \|", line)]
    assert [row.split("|")[1].strip() for row in rows] == ["1", "2"]
    assert all(re.search(r"\| \d+\.\d s \| \d+\.\d s \|", row) for row in rows), rows
    for bad in ("0", "two"):
        with pytest.raises(SystemExit):
            estimate_cost.main(["--layers", bad])
        assert "--layers" in capsys.readouterr().err

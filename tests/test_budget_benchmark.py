"""benchmarks/budget.py (the plan against the alternatives users pick for a memory budget) runs end to end on
tiny sizes and prints its tables with measured figures, so the published docs/budget.md can be re-made."""

import pathlib
import re
import sys

import pytest

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
def test_budget_quick_prints_both_tables(capsys, _process_state_restored):
    import budget

    text = budget.main(["--quick"])
    assert capsys.readouterr().out.strip() == text.strip()
    for title in ("### Llama-like", "### ResNet-18"):
        assert title in text
        section = text[text.index(title):]
        rows = [line for line in section.splitlines() if line.startswith("| (")]
        labels = [row.split("|")[1].strip() for row in rows[:6]]
        assert labels == [label for key, label in budget.ALTERNATIVES if key != "stock"]
        plan_row = rows[5]
        # the plan's cells are measured: a batch size (or "none") and a time or a reason, never an error
        assert "error" not in plan_row and re.search(r"\| (\d+|none) \|", plan_row)
        assert "Target:" in section
    assert "n/a on CPU" in text  # offloaded checkpointing has nothing to offload to on CPU


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

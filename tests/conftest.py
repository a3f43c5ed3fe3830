"""Test-session settings.

Full garbage collections are what ``slimgrad.peak_bytes`` starts with (so that an earlier step's garbage is not
freed inside the measured one), and a worker that has imported torch, transformers, diffusers and peft holds
millions of tracked objects: each collection took 0.3-0.7 s, a third of the suite's CPU time (392 of ~1140 s
over 700 calls). At the first test of each module, after a collection, the objects alive then (modules,
classes, session fixtures, caches) are frozen (``gc.freeze``): later collections skip them and still free
every cycle made since. What those collections free, and so every measured peak, is unchanged.
"""

from __future__ import annotations

import gc

import pytest

_last_module = [None]


def pytest_runtest_setup(item):
    module = getattr(item, "module", None)
    if module is not _last_module[0]:
        _last_module[0] = module
        gc.collect()
        gc.freeze()


def pytest_unconfigure(config):
    """Give the frozen objects back to the collector before the interpreter exits, as it would find them without
    the freeze (nanobind, under triton, otherwise reports the ones never collected as leaks)."""
    gc.unfreeze()
    gc.collect()


#: test modules that run the chunked loss on tiny models whose head trains, where a call of few tokens would take
#: stock's logits (hf_loss.CHOOSE_BY_SIZE, tested by test_hf_loss.py::test_a_trained_head_with_few_tokens_keeps_...)
_CHUNKED_PATH_TESTS = {"test_hf_loss", "test_trainer", "test_claims", "test_budget_integrations", "test_gaps",
                       "test_signatures", "test_no_leak", "test_fsdp_classes", "test_bnb"}


@pytest.fixture(autouse=True)
def _chunked_path_whatever_the_size(request, monkeypatch):
    if request.module.__name__.rsplit(".", 1)[-1] in _CHUNKED_PATH_TESTS:
        from slimgrad.integrations import hf_loss

        monkeypatch.setattr(hf_loss, "CHOOSE_BY_SIZE", False)

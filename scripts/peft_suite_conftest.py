"""pytest plugin for running peft's own test suite with every adapter injection converted by slimgrad.

Loaded with ``-p peft_suite_conftest`` (``scripts/`` on ``PYTHONPATH``), see ``scripts/peft_suite.sh``. Without
``SLIMGRAD_CONVERT=1`` it does nothing, so the stock run and the converted run load the same plugins.

Why ``BaseTuner.inject_adapter``: it is the one method every path that puts adapter layers into a model goes
through in peft 0.17-0.21 (``get_peft_model``, ``PeftModel.__init__``, ``add_adapter``, ``load_adapter``,
``from_pretrained``, ``inject_adapter_in_model``, ``add_weighted_adapter``, mixed models; the tuners that override
it call ``super()``). Wrapping it converts the model right after peft has replaced the target modules, before
peft's post-injection hooks and before the test runs anything on it, as a user calling ``slimgrad.convert`` after
``get_peft_model`` would. Converting twice changes nothing, so nested calls are harmless.

``SLIMGRAD_CONVERT_LOG=PATH`` appends one JSON line per test: its node id, the number of injections, and the
module types slimgrad converted, so the comparison can show that conversions happened (not a silent no-op).
"""

from __future__ import annotations

import functools
import json
import os

import pytest

_per_test: dict = {"injections": 0, "converted": {}}


def _enabled() -> bool:
    return os.environ.get("SLIMGRAD_CONVERT") == "1"


def pytest_configure(config):
    if not _enabled():
        return
    from peft.tuners.tuners_utils import BaseTuner

    import slimgrad

    original = BaseTuner.inject_adapter
    if getattr(original, "_slimgrad_suite", False):
        return

    @functools.wraps(original)
    def inject_then_convert(self, model, *args, **kwargs):
        result = original(self, model, *args, **kwargs)
        _, rep = slimgrad.convert(model, inplace=True, report=True)
        _per_test["injections"] += 1
        for name, count in rep.converted_types.items():
            _per_test["converted"][name] = _per_test["converted"].get(name, 0) + count
        return result

    inject_then_convert._slimgrad_suite = True
    BaseTuner.inject_adapter = inject_then_convert
    config.addinivalue_line("markers", "slimgrad_converted: run with slimgrad.convert after every adapter injection")


def pytest_report_header(config):
    if _enabled():
        return "slimgrad: every peft adapter injection is converted in place (SLIMGRAD_CONVERT=1)"
    return "slimgrad: stock run (SLIMGRAD_CONVERT unset)"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _per_test["injections"] = 0
    _per_test["converted"] = {}
    yield
    path = os.environ.get("SLIMGRAD_CONVERT_LOG")
    if path and _enabled():
        with open(path, "a") as handle:
            handle.write(json.dumps({"test": item.nodeid, **_per_test}) + "\n")

"""Integrations load lazily, only for libraries the user imported, and register their classes whatever the
order in which model code was imported."""

import subprocess
import sys

import pytest


def _run(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().splitlines()[-1]


def test_nothing_loads_without_the_library():
    out = _run("import sys, slimgrad, torch; slimgrad.convert(torch.nn.Conv2d(1, 1, 1)); "
               "print(sorted(m for m in ('transformers', 'peft', 'bitsandbytes') if m in sys.modules))")
    assert out == "[]"


@pytest.mark.slow
def test_transformers_classes_register_even_before_model_code_is_imported():
    pytest.importorskip("transformers")
    out = _run("import transformers, slimgrad\n"
               "from slimgrad.integrations import load_available\n"
               "load_available()\n"
               "from slimgrad._registry import REPLACEMENTS\n"
               "from transformers.models.llama import modeling_llama as m\n"
               "from slimgrad._notices import class_gap\n"
               "missing = [(c.__name__, str(class_gap(c))) for c in (m.LlamaRMSNorm, m.LlamaMLP, m.LlamaForCausalLM)\n"
               "           if c not in REPLACEMENTS]\n"
               "print(missing or 'True')")
    assert out == "True", f"not registered (class, recorded gap): {out}"

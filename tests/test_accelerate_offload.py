"""Models whose weights accelerate offloads (cpu_offload, disk_offload, an offloaded device_map): they sit on the
meta device between calls and a hook loads each module's weights for its forward (found by the model-loading sweep)."""

import warnings

import pytest
import torch

accelerate = pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

import slimgrad  # noqa: E402
from slimgrad import _notices  # noqa: E402


def _offloaded_llama():
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    return accelerate.cpu_offload(transformers.LlamaForCausalLM(cfg), execution_device="cpu")


IDS = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("converted", [False, True])
def test_estimate_refuses_offloaded_weights_naming_accelerate(converted):
    """Simulated, accelerate's hook rebuilt each offloaded weight as ``FakeTensor(...)`` and raised an internal
    TypeError (missing 'fake_mode'), for stock and converted models, while the real step runs."""
    model = _offloaded_llama()
    model = slimgrad.convert(model) if converted else model
    with pytest.raises(ValueError, match="accelerate offloads") as info:
        slimgrad.estimate(model, input_ids=IDS, labels=IDS)
    assert "before dispatching" in str(info.value)
    model(input_ids=IDS, labels=IDS).loss.backward()  # the real step runs


def test_peak_bytes_measures_a_step_of_an_offloaded_model():
    """The parameters are on meta between calls, and peak_bytes took the step for a meta one ("the inputs are on the
    meta device") though it runs on CPU."""
    model = _offloaded_llama()
    assert next(model.parameters()).is_meta
    peak = slimgrad.peak_bytes(lambda: model(input_ids=IDS, labels=IDS).loss.backward())
    assert peak > 0


def test_chunked_loss_on_offloaded_weights_says_accelerate_is_why():
    """The head stays stock there (its weight is loaded by the hook only for the head's own forward), and the reason
    blamed TRL's fused head, which nothing here uses."""
    _notices.reset_warned()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, report = slimgrad.convert(_offloaded_llama(), chunked_loss=True, report=True)
    reasons = [g.message() for g in report.gaps] + [str(w.message) for w in caught]
    chunked = [r for r in reasons if "chunked_loss" in r or "accelerate offloads" in r]
    assert chunked and all("accelerate offloads" in r and "TRL" not in r for r in chunked), reasons

"""Every replacement's forward has exactly the stock forward's signature.

Code reads it: ``transformers.Trainer`` keeps only the dataset columns that ``model.forward`` names (a
``(*args, **kwargs)`` forward made it drop every column), ``Trainer`` decides from ``**kwargs`` whether to
pass ``num_items_in_batch``, and ``generate`` validates model kwargs against it.
"""

from __future__ import annotations

import importlib.util
import inspect

import pytest
import torch
from torch import nn

import slimgrad
from slimgrad._registry import ORIGINALS, REPLACEMENTS, register
from slimgrad.integrations import INTEGRATIONS, load_available

for _library in INTEGRATIONS:  # every integration whose library is installed registers its classes
    if importlib.util.find_spec(_library) is not None:
        importlib.import_module(_library)
# the MoE integration registers the families the user's code imported (it imports none itself): import some here
for _family in ("mixtral", "qwen2_moe", "gpt_oss"):
    try:
        importlib.import_module(f"transformers.models.{_family}.modeling_{_family}")
    except ImportError:  # transformers not installed, or a version without this family
        pass
load_available()


def _name(stock):
    return f"{stock.__module__}.{stock.__qualname__}"


@pytest.mark.parametrize("stock", list(REPLACEMENTS), ids=_name)
def test_replacement_forward_has_stock_signature(stock):
    replacement = REPLACEMENTS[stock]
    assert inspect.signature(replacement.forward) == inspect.signature(stock.forward)


def test_registry_covers_the_integrations():
    """The parametrized test above is not vacuous: torch's families and the installed integrations are in."""
    assert nn.Conv2d in REPLACEMENTS and nn.ConvTranspose2d in REPLACEMENTS
    if importlib.util.find_spec("transformers") is not None:
        import transformers

        from slimgrad._notices import class_gap

        # hf_loss registers every *ForCausalLM head (its (*args, **kwargs) forward binds the stock signature)
        assert transformers.LlamaForCausalLM in REPLACEMENTS, (
            f"hf_loss did not register LlamaForCausalLM on transformers {transformers.__version__}: "
            f"{class_gap(transformers.LlamaForCausalLM)}")
        assert transformers.models.gemma.modeling_gemma.GemmaRMSNorm in REPLACEMENTS  # forward(self, x)
        if importlib.util.find_spec("transformers.integrations.moe") is not None:  # transformers 5's fused experts
            assert transformers.models.mixtral.modeling_mixtral.MixtralExperts in REPLACEMENTS


def test_bound_forward_signature_after_convert():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, vocab_size=32)
    model = transformers.LlamaForCausalLM(cfg)
    before = list(inspect.signature(model.forward).parameters)
    _, report = slimgrad.convert(model, inplace=True, chunked_loss=True, report=True)
    assert type(model) in ORIGINALS, f"chunked_loss did not engage on LlamaForCausalLM: {report}"
    assert list(inspect.signature(model.forward).parameters) == before
    assert "labels" in before and "kwargs" in before


def test_keyword_call_with_stock_parameter_name():
    """A shared replacement forward that names its input differently still takes the stock name."""
    pytest.importorskip("transformers")
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    torch.manual_seed(0)
    stock = GemmaRMSNorm(8)
    nn.init.normal_(stock.weight)
    slim = slimgrad.convert(stock)
    assert type(slim) in ORIGINALS
    x = torch.randn(3, 8)
    torch.testing.assert_close(slim(x=x), stock(x=x), rtol=0, atol=0)
    torch.testing.assert_close(slim(x), stock(x), rtol=0, atol=0)
    with pytest.raises(TypeError):
        slim(hidden_states=x)  # the stock forward does not take it either
    with pytest.raises(TypeError):
        stock(hidden_states=x)


def test_incompatible_replacement_is_refused():
    class Stock(nn.Module):
        def forward(self, x, scale=1.0):
            return x * scale

    class Wrong(Stock):
        def forward(self, x):
            return x

    with pytest.raises(TypeError, match="slimgrad: Wrong.forward"):
        register(Stock)(Wrong)
    assert Stock not in REPLACEMENTS and Wrong not in ORIGINALS

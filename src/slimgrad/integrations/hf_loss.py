"""Hugging Face causal-LM heads whose training loss is computed without materialising the logits.

Opt-in: only ``slimgrad.convert(model, chunked_loss=True)`` swaps these in, because **with
chunked_loss=True a training forward with labels returns the loss and no logits** (``output.logits is
None``). That is the point: the head's (tokens x vocab) fp32 logits, and the log-softmax stock autograd
keeps for backward, are the largest tensors of a fine-tuning step; here the loss comes from
:func:`slimgrad.functional.cross_entropy.fused_linear_cross_entropy`, which keeps only the hidden states
and the targets.

When the chunked path runs: ``labels`` given, grad enabled, ``logits_to_keep == 0``, the model's
``loss_function`` is transformers' ``ForCausalLMLoss`` (not a custom one), and ``lm_head`` is a plain
``nn.Linear`` (or slimgrad's drop-in for it) with no hooks whose size is the vocabulary the loss uses. Then the body
(``self.model(...)`` / ``self.transformer(...)``) is called exactly as stock calls it, and the loss follows
``ForCausalLMLoss``: labels shifted left and padded with ``ignore_index`` (or ``shift_labels`` as given),
mean over non-ignored tokens, or sum divided by ``num_items_in_batch`` when that is passed; Gemma's
``final_logit_softcapping`` is applied in the head's dtype before the fp32 upcast, as stock does. Every
other call (no labels, ``torch.no_grad()``, generation, ``logits_to_keep`` set, a LoRA-wrapped or hooked
``lm_head``) runs the stock forward unchanged and returns logits.

A class is registered only when the source of its ``forward`` is, as a syntax tree, one of the three
forwards below (read from transformers 5.23: Llama/Qwen2/Qwen3/Mistral/Phi3/Olmo2..., Gemma2/Gemma3 with
soft-capping, GPT-2), so a family whose head does anything else (logit scaling, extra outputs) is never
converted.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import textwrap

import torch
import torch.nn.functional as F
from torch import nn

from slimgrad._registry import ORIGINALS, REPLACEMENTS, register_forward
from slimgrad.functional.cross_entropy import fused_linear_cross_entropy
from slimgrad.integrations._hf_classes import loaded_transformers_classes

__all__ = ["register_loaded"]

#: Modeling modules imported eagerly so their heads are registered even when loaded after this module.
CORE_MODELS = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "olmo2", "phi3", "gpt2")

_DECODER = '''
@can_return_tuple
@auto_docstring
def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, inputs_embeds=None,
            labels=None, use_cache=None, logits_to_keep=0, **kwargs):
    outputs: BaseModelOutputWithPast = self.model(input_ids=input_ids, attention_mask=attention_mask,
        position_ids=position_ids, past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
        **kwargs)
    hidden_states = outputs.last_hidden_state
    hidden_states = slice_logits_to_keep(hidden_states, logits_to_keep)
    logits = self.lm_head(hidden_states)
    loss = None
    if labels is not None:
        loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
    return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=outputs.past_key_values,
        hidden_states=outputs.hidden_states, attentions=outputs.attentions)
'''

_SOFTCAP = '''
@can_return_tuple
@auto_docstring
def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, inputs_embeds=None,
            labels=None, use_cache=None, logits_to_keep=0, **kwargs):
    outputs: BaseModelOutputWithPast = self.model(input_ids=input_ids, attention_mask=attention_mask,
        position_ids=position_ids, past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
        **kwargs)
    hidden_states = outputs.last_hidden_state
    hidden_states = slice_logits_to_keep(hidden_states, logits_to_keep)
    logits = self.lm_head(hidden_states)
    if self.config.final_logit_softcapping is not None:
        logits = logits / self.config.final_logit_softcapping
        logits = torch.tanh(logits)
        logits = logits * self.config.final_logit_softcapping
    loss = None
    if labels is not None:
        loss = self.loss_function(logits, labels, self.vocab_size, **kwargs)
    return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=outputs.past_key_values,
        hidden_states=outputs.hidden_states, attentions=outputs.attentions)
'''

_GPT2 = '''
@can_return_tuple
@auto_docstring
def forward(self, input_ids=None, past_key_values=None, attention_mask=None, token_type_ids=None, position_ids=None,
            inputs_embeds=None, encoder_hidden_states=None, encoder_attention_mask=None, labels=None, use_cache=None,
            logits_to_keep=0, **kwargs):
    transformer_outputs: BaseModelOutputWithPastAndCrossAttentions = self.transformer(input_ids,
        past_key_values=past_key_values, attention_mask=attention_mask, token_type_ids=token_type_ids,
        position_ids=position_ids, inputs_embeds=inputs_embeds, encoder_hidden_states=encoder_hidden_states,
        encoder_attention_mask=encoder_attention_mask, use_cache=use_cache, **kwargs)
    hidden_states = transformer_outputs.last_hidden_state
    hidden_states = slice_logits_to_keep(hidden_states, logits_to_keep)
    logits = self.lm_head(hidden_states)
    loss = None
    if labels is not None:
        loss = self.loss_function(logits, labels, vocab_size=self.config.vocab_size, **kwargs)
    return CausalLMOutputWithCrossAttentions(loss=loss, logits=logits,
        past_key_values=transformer_outputs.past_key_values, hidden_states=transformer_outputs.hidden_states,
        attentions=transformer_outputs.attentions, cross_attentions=transformer_outputs.cross_attentions)
'''


@dataclasses.dataclass(frozen=True)
class _Head:
    """What differs between the matched forwards."""

    body: str  # attribute holding the base model
    output: str  # output class name in transformers.modeling_outputs
    fields: tuple[str, ...]  # output fields copied from the body's output
    softcap: bool  # applies config.final_logit_softcapping
    vocab_from_config: bool  # the loss's vocab_size is config.vocab_size (else self.vocab_size)


_DECODER_FIELDS = ("past_key_values", "hidden_states", "attentions")


def _canonical_node(node) -> str | None:
    """A function's syntax tree without its name, docstring and type annotations."""
    if not isinstance(node, ast.FunctionDef):
        return None
    node.name = "forward"
    node.returns = None
    a = node.args
    for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]:
        if arg is not None:
            arg.annotation = None
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        node.body = body[1:]
    return ast.dump(node)


def _canonical(fn) -> str | None:
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError, IndentationError):
        return None
    return _canonical_node(tree.body[0]) if tree.body else None


def _template(source: str) -> str:
    return _canonical_node(ast.parse(source).body[0])


_TEMPLATES = {
    _template(_DECODER): _Head("model", "CausalLMOutputWithPast", _DECODER_FIELDS, False, True),
    _template(_SOFTCAP): _Head("model", "CausalLMOutputWithPast", _DECODER_FIELDS, True, False),
    _template(_GPT2): _Head("transformer", "CausalLMOutputWithCrossAttentions",
                            (*_DECODER_FIELDS, "cross_attentions"), False, True),
}

#: stock class -> (what its forward does, its forward's signature)
_HEADS: dict[type, tuple[_Head, inspect.Signature]] = {}


def _match(cls) -> _Head | None:
    """The matched forward of ``cls``, checking also that the names it calls are transformers' own."""
    forward = cls.__dict__.get("forward")
    if forward is None:
        return None
    head = _TEMPLATES.get(_canonical(forward))
    if head is None:
        return None
    from transformers import modeling_outputs, modeling_utils
    from transformers.utils import generic

    names = getattr(inspect.unwrap(forward), "__globals__", {})
    expected = {"slice_logits_to_keep": modeling_utils.slice_logits_to_keep,
                "can_return_tuple": generic.can_return_tuple,
                head.output: getattr(modeling_outputs, head.output)}
    if any(names.get(k) is not v for k, v in expected.items()):
        return None
    return head


def _unsupported_reason(module) -> str | None:
    head = getattr(module, "lm_head", None)
    if ORIGINALS.get(type(head), type(head)) is not nn.Linear:
        return (f"lm_head is {type(head).__name__}, not torch.nn.Linear (a LoRA or quantized head?); the chunked "
                f"loss reads its weight directly, so the head is left as stock")
    return None


def _plan(self, stock, args, kwargs):
    """The bound arguments and options of a call the chunked path can honour, or None for stock."""
    if not torch.is_grad_enabled():
        return None
    head, signature = _HEADS[stock]
    kwargs = dict(kwargs)
    return_dict = self.config.return_dict if hasattr(self, "config") else True  # as can_return_tuple decides
    passed = kwargs.pop("return_dict", return_dict)
    if passed is not None:
        return_dict = passed
    try:
        bound = signature.bind(self, *args, **kwargs)
    except TypeError:
        return None  # stock raises its own error
    arguments = dict(bound.arguments)
    if arguments.get("labels") is None:
        return None
    keep = arguments.get("logits_to_keep", 0)
    if isinstance(keep, torch.Tensor) or keep != 0:
        return None
    lm_head = self.lm_head
    if (ORIGINALS.get(type(lm_head), type(lm_head)) is not nn.Linear or lm_head._forward_hooks
            or lm_head._forward_pre_hooks or hasattr(lm_head, "_hf_hook") or nn.modules.module._global_forward_hooks
            or nn.modules.module._global_forward_pre_hooks):
        return None
    vocab = self.config.vocab_size if head.vocab_from_config else self.vocab_size
    if lm_head.out_features != vocab:
        return None
    from transformers.loss.loss_utils import ForCausalLMLoss

    if self.loss_function is not ForCausalLMLoss:
        return None
    softcap = self.config.final_logit_softcapping if head.softcap else None
    if softcap is not None and not softcap > 0:
        return None  # stock divides by it; leave whatever that gives to stock
    extra = arguments.pop("kwargs", {})
    if not isinstance(extra.get("ignore_index", -100), int):
        return None
    return head, arguments, extra, softcap, return_dict


def _chunked(self, head: _Head, arguments, extra, softcap, return_dict):
    labels = arguments.pop("labels")
    arguments.pop("self")
    arguments.pop("logits_to_keep", None)
    outputs = getattr(self, head.body)(**arguments, **extra)
    hidden = outputs.last_hidden_state
    # ForCausalLMLoss, without the logits.
    ignore_index = extra.get("ignore_index", -100)
    shift_labels = extra.get("shift_labels")
    num_items = extra.get("num_items_in_batch")
    if shift_labels is None:
        labels = F.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:].contiguous()
    shift_labels = shift_labels.reshape(-1).to(hidden.device)
    reduction = "sum" if num_items is not None else "mean"
    loss = fused_linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), self.lm_head.weight, shift_labels,
                                      self.lm_head.bias, ignore_index=ignore_index, reduction=reduction,
                                      softcap=softcap)
    if num_items is not None:
        if torch.is_tensor(num_items):
            num_items = num_items.to(loss.device)
        loss = loss / num_items
    from transformers import modeling_outputs

    output = getattr(modeling_outputs, head.output)(
        loss=loss, logits=None, **{name: getattr(outputs, name) for name in head.fields})
    return output if return_dict else output.to_tuple()


def _forward(self, *args, **kwargs):
    # Takes anything and binds with the stock signature itself (_plan); register_forward gives each class's
    # copy of it the stock forward's signature, so Trainer's column dropping sees the stock parameters.
    stock = ORIGINALS[type(self)]
    plan = _plan(self, stock, args, kwargs)
    if plan is None:
        return stock.forward(self, *args, **kwargs)
    return _chunked(self, *plan)


_REJECTED: set[type] = set()  # causal-LM classes whose forward was read and matched no known one


def register_loaded() -> list[type]:
    """Register every causal-LM class of an already imported transformers modeling module whose forward
    matches one of the known ones; returns the newly registered stock classes."""
    added = []
    for _, cls in loaded_transformers_classes():
        if (cls in REPLACEMENTS or cls in _HEADS or cls in _REJECTED
                or not (cls.__name__.endswith("ForCausalLM") or cls.__name__.endswith("LMHeadModel"))):
            continue
        head = _match(cls)
        if head is None:
            _REJECTED.add(cls)
            continue
        _HEADS[cls] = (head, inspect.signature(inspect.unwrap(cls.__dict__["forward"])))
        register_forward(cls, _forward, module=__name__, unsupported_reason=_unsupported_reason,
                         option="chunked_loss")
        added.append(cls)
    return added


refresh = register_loaded  # called by slimgrad.integrations.load_available on every convert

for _name in CORE_MODELS:
    try:
        importlib.import_module(f"transformers.models.{_name}.modeling_{_name}")
    except ImportError:  # a transformers without that family
        pass
register_loaded()

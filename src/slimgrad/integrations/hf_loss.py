"""Hugging Face causal-LM heads whose training loss is computed without materialising the logits.

Opt-in: only ``slimgrad.convert(model, chunked_loss=True)`` swaps these in, because **with
chunked_loss=True a training forward with labels returns the loss and no logits** (``output.logits is
None``). That is the point: the head's (tokens x vocab) fp32 logits, and the log-softmax stock autograd
keeps for backward, are the largest tensors of a fine-tuning step; here the loss comes from
:func:`slimgrad.functional.cross_entropy.fused_linear_cross_entropy`, which keeps only the hidden states
and the targets.

Why behaviour, not source: transformers edits its heads' forwards every few releases (5.24 renamed
``past_key_values`` to ``cache`` in 315 files and added a decorator), and matching their text stopped the
feature silently. So the chunked path is built from the model's public parts only, the ones every release
keeps: the body (``model.base_model``, else the one child besides the output embedding), the output
embedding (``get_output_embeddings()``), the config's vocabulary, and ``model.loss_function``. Every
transformers class named ``*ForCausalLM`` / ``*LMHeadModel`` with a forward and ``get_output_embeddings`` is
registered; whether the chunked path gives stock's numbers is checked by running it, once per (class, config,
dtype, device type), when ``convert`` meets the module: on a tiny random batch, the stock forward and the
chunked path must agree on the loss (also with ``num_items_in_batch``) and on the gradient reaching the
hidden states, in training and eval mode. What a head does besides its linear layer is tried from what its
config names, plainest first (:func:`_recipes`: a soft cap, a logit scale, BART's unshifted loss), and a head
module around the output embedding (BERT's transform) runs up to that layer. A head that does anything else
(a logit transform its config does not name, an auxiliary loss, other outputs) fails the check and is left
as stock with a warning (``SlimgradWarning`` via ``convert``). The check leaves the model as it found it
(training flags, buffers, ``.grad``, the RNG).

When the chunked path runs, per call: grad enabled, ``labels`` given, ``logits_to_keep`` absent or 0, the
model's ``loss_function`` is transformers' ``ForCausalLMLoss`` itself, the output embedding is a plain
``nn.Linear`` (or slimgrad's drop-in for it) without hooks whose size is the config's vocabulary, and every
argument can be handed to the body. Then the body is called with the stock arguments (less ``labels``,
``logits_to_keep``, ``return_dict``) and the loss follows ``ForCausalLMLoss``: labels shifted left and padded
with ``ignore_index`` (or ``shift_labels`` as given), mean over non-ignored tokens, or sum divided by
``num_items_in_batch``; a soft cap is applied in the head's dtype before the fp32 upcast, a scale to the head's
input and bias (rounding like stock's within the check's tolerance). The
output is the class stock returns (learnt by the check), ``logits=None``, the body's fields of the same names;
a tuple where stock would return one (stock's positions, None in the logits' slot). No grad, no labels or
``logits_to_keep`` set run the stock forward silently (logits wanted); every other reason to run stock (a wrapped
loss function, a hooked or LoRA head, an argument the body does not take, an output field such as a MoE
``aux_loss`` the chunked path cannot reproduce) warns once, naming class, transformers version and reason, and
gives stock's numbers.

TRL's ``SFTTrainer`` computes its own loss with its own chunked head (``add_fused_lm_head`` replaces the
instance's ``forward`` and calls the body): a head whose forward was replaced on the instance is left as
stock with a warning at convert time (TRL already keeps no logits; nothing is done twice). See
docs/chunked_loss.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import itertools
import json
import os

import torch
import torch.nn.functional as F
from torch import nn

from slimgrad import _notices
from slimgrad._forward_chain import reaches
from slimgrad._registry import ORIGINALS, REPLACEMENTS, register_forward
from slimgrad.functional.cross_entropy import default_chunk_size, fused_linear_cross_entropy
from slimgrad.integrations._hf_classes import loaded_transformers_classes
from slimgrad.integrations._hooks import global_module_hooks, module_hooks

__all__ = ["check", "register_loaded"]

#: Modeling modules imported eagerly so their heads are registered even when loaded after this module.
CORE_MODELS = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "olmo2", "phi3", "gpt2")

FAMILY = "chunked_loss"
_LOSS_KWARGS = ("num_items_in_batch", "ignore_index", "shift_labels")  # ForCausalLMLoss's keywords
#: body output fields whose presence never changes the loss stock computes
_HARMLESS = frozenset({"last_hidden_state", "past_key_values", "cache", "hidden_states", "attentions",
                       "cross_attentions"})
CHECK_TOKENS = 8  # the check's batch: 1 x CHECK_TOKENS random tokens


def _subject(cls) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _decline(stock: type, reason: str) -> None:
    """Warn once that a training call of ``stock`` runs the stock forward (with its logits), and why."""
    _notices.notify(_notices.Gap("transformers", _notices.library_version("transformers"), _subject(stock), FAMILY,
                                 reason + "; this call runs the stock forward (same numbers, full logits)"))


# -- the call: what the chunked path needs from one forward call -------------------------------------------------

_SIGNATURES: dict[type, inspect.Signature] = {}


def _signature(cls) -> inspect.Signature:
    """The forward's signature; ``inspect.signature`` follows ``__wrapped__`` through transformers' decorators."""
    sig = _SIGNATURES.get(cls)
    if sig is None:
        sig = _SIGNATURES[cls] = inspect.signature(cls.forward)
    return sig


@dataclasses.dataclass
class _Call:
    body: nn.Module
    body_args: dict
    pre_head: nn.Module | None  # the child of the model holding the output embedding (a BERT-like MLM head)
    labels: torch.Tensor
    head: nn.Linear
    ignore_index: int
    shift_labels: torch.Tensor | None
    num_items: object
    return_dict: bool


def _config_value(config, name):
    if hasattr(config, name):
        return getattr(config, name)
    text = getattr(config, "get_text_config", None)
    return getattr(text(), name, None) if text is not None else None


def _describe(fn) -> str:
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    return f"{getattr(fn, '__module__', None) or type(fn).__module__}.{name}"


_UNLABELLED = ("it was called in training without labels: its caller computes the loss from the logits (a model "
               "around it, such as BLIP-2's or an encoder-decoder's; TRL's ORPO, CPO or value head; a custom loss), "
               "which the chunked path cannot do for it")


def _plan(self, stock, args, kwargs) -> _Call | str | None:
    """What the chunked path would run for ``self(*args, **kwargs)``: a :class:`_Call`; None where stock is
    what the caller wants (no grad, no labels, logits asked for, a call stock itself refuses); a reason string
    where the chunked path cannot honour a training call (the caller warns and runs stock)."""
    if not torch.is_grad_enabled():
        return None
    kwargs = dict(kwargs)
    return_dict = self.config.return_dict if hasattr(self, "config") else True  # as can_return_tuple decides
    passed = kwargs.pop("return_dict", return_dict)
    if passed is not None:
        return_dict = passed
    sig = _signature(stock)
    try:
        bound = sig.bind(self, *args, **kwargs)
    except TypeError:
        return None  # stock raises its own error
    params = list(sig.parameters.values())
    arguments = dict(bound.arguments)
    arguments.pop(params[0].name)
    extra = {}
    for p in params[1:]:
        if p.kind is p.VAR_KEYWORD:
            extra = arguments.pop(p.name, {})
        elif p.kind is p.VAR_POSITIONAL and arguments.pop(p.name, ()):
            return "the call passes extra positional arguments, which the chunked path cannot name for the body"
    labels = arguments.pop("labels", extra.pop("labels", None))
    if labels is None:
        # a training call without labels: its caller computes the loss from the logits, which the chunked path
        # cannot serve (said once, not silently; evaluation and no-grad calls want logits anyway)
        return _UNLABELLED if self.training else None
    keep = arguments.pop("logits_to_keep", extra.pop("logits_to_keep", 0))
    if isinstance(keep, torch.Tensor) or keep != 0:
        return None
    try:
        loss_function = self.loss_function
    except Exception as e:  # noqa: BLE001 - a property that fails: stock will say why
        return f"reading model.loss_function raised {type(e).__name__}"
    from transformers.loss.loss_utils import ForCausalLMLoss

    if loss_function is not ForCausalLMLoss:
        return (f"its loss_function is {_describe(loss_function)}, not transformers' ForCausalLMLoss (the only loss "
                f"the chunked path reproduces)")
    head = self.get_output_embeddings()
    if ORIGINALS.get(type(head), type(head)) is not nn.Linear:
        return (f"its output embedding is {type(head).__module__}.{type(head).__qualname__}, not torch.nn.Linear "
                f"(a LoRA or quantized head?); the chunked loss reads its weight directly")
    if module_hooks(head) or hasattr(head, "_hf_hook") or global_module_hooks():
        return "its output embedding has hooks (accelerate offload, a user hook, a global module hook), which the " \
               "chunked path would skip"
    vocab = _config_value(self.config, "vocab_size")
    if head.out_features != vocab:
        return f"its output embedding has {head.out_features} outputs but the config's vocab_size is {vocab}"
    body = _body(self, head)
    if body is None:
        return (f"it has no body module (base_model_prefix {getattr(self, 'base_model_prefix', None)!r}, and not "
                f"exactly one child besides the output embedding)")
    body_sig = _signature(type(body))
    names = {p.name for p in body_sig.parameters.values() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    takes_any = any(p.kind is p.VAR_KEYWORD for p in body_sig.parameters.values())
    body_args = {}
    for name, value in [*arguments.items(), *extra.items()]:
        if name in names or takes_any:
            body_args[name] = value
        elif name in sig.parameters and value is sig.parameters[name].default:
            continue  # a head parameter at its default: stock passes nothing of note
        elif name in _LOSS_KWARGS:
            continue  # the loss's own keywords: a body that does not take them never got them
        else:
            return f"the argument {name!r} cannot be passed to its body {type(body).__name__}.forward"
    ignore_index = extra.get("ignore_index", -100)
    if not isinstance(ignore_index, int):
        return f"ignore_index is {type(ignore_index).__name__}, not an int"
    return _Call(body, body_args, _pre_head(self, head), labels, head, ignore_index, extra.get("shift_labels"),
                 extra.get("num_items_in_batch"), bool(return_dict))


def _body(self, head) -> nn.Module | None:
    """The body: ``base_model`` (``base_model_prefix``), else the one child that is not the output embedding."""
    body = getattr(self, "base_model", self)
    if isinstance(body, nn.Module) and body is not self:
        return body
    others = [c for c in self.children() if c is not head]
    return others[0] if len(others) == 1 else None


def _pre_head(self, head) -> nn.Module | None:
    """The model's child that holds the output embedding deeper inside (BERT's ``cls``: a transform, then the
    decoder), or None where the output embedding is a child itself."""
    for child in self.children():
        if child is head:
            return None
        if any(m is head for m in child.modules()):
            return child
    return None


class _Reached(Exception):
    """Raised by a pre-hook on the output embedding: what the head module hands it, with its autograd graph."""


def _through(pre_head: nn.Module, head: nn.Module, hidden):
    """Run ``pre_head`` on ``hidden`` up to its output embedding, and return that layer's input (the rest of
    ``pre_head``, the logits, never runs)."""
    def reached(module, args):
        raise _Reached(args[0])

    handle = head.register_forward_pre_hook(reached)
    try:
        pre_head(hidden)
    except _Reached as e:
        return e.args[0]
    finally:
        handle.remove()
    raise RuntimeError(f"{type(pre_head).__name__} did not call its output embedding")


@dataclasses.dataclass(frozen=True)
class _Recipe:
    """What a head does to its logits besides the linear layer, read from its config and verified by the check:
    a scale (``logits * scale``; ``where="hidden"``: the head scales its input instead, as MiniCPM3) computed
    as a scale of the head's input (and bias), and a soft cap ``tanh(z / softcap) * softcap``."""

    softcap: float | None = None
    softcap_fp32: bool = False  # the cap after the logits' fp32 upcast (Beam), not in the head's dtype (Gemma 2/3)
    scale: float | None = None
    divide: bool = False  # scale by dividing (the config's value divides, as Granite's logits_scaling)
    where: str = "logits"
    shift: bool = True  # ForCausalLMLoss; False: CrossEntropyLoss()(logits.view(-1, V), labels.view(-1)) (BART-like)
    num_items: bool = True  # False: the head does not hand num_items_in_batch to its loss (transformers 4.x Mamba)
    loss_kwargs_to_body: bool = True  # False: the loss's keywords go to the loss only (transformers 4.x Bloom)

    def head_input(self, hidden, bias):
        if self.scale is None:
            return hidden, bias
        if self.divide:
            return hidden / self.scale, (None if bias is None or self.where == "hidden" else bias / self.scale)
        return hidden * self.scale, (None if bias is None or self.where == "hidden" else bias * self.scale)

    def describe(self) -> str:
        parts = []
        if self.softcap is not None:
            parts.append(f"soft cap {self.softcap}" + (" in fp32" if self.softcap_fp32 else ""))
        if self.scale is not None:
            parts.append(f"{self.where} {'divided' if self.divide else 'multiplied'} by {self.scale}")
        if not self.shift:
            parts.append("unshifted mean cross-entropy")
        if not self.num_items:
            parts.append("num_items_in_batch not passed to the loss")
        if not self.loss_kwargs_to_body:
            parts.append("the loss's keywords not passed to the body")
        return ", ".join(parts) or "plain"


_PLAIN = _Recipe()
#: config attributes holding a logit scale (TRL's add_fused_lm_head reads the same): (name, divides)
_SCALES = (("logit_scale", False), ("output_multiplier", False), ("lm_head_multiplier", False),
           ("logits_scaling", True), ("logits_scaling", False))
_SOFTCAPS = ("final_logit_softcapping", "logits_soft_cap")


def _modifiers(module) -> tuple:
    """What the check's verdict depends on that can change after it: the config values a recipe is read from (a
    user setting ``logit_scale``) and the head's dtype and device (``model.to(torch.bfloat16)`` after converting in
    fp32: BART's bf16 loss is computed on bf16 logits, which the fp32 check never saw). A change makes the module
    be checked again before its next chunked call."""
    config = module.config
    head = module.get_output_embeddings()
    weight = getattr(head, "weight", None)
    where = (weight.dtype, weight.device.type) if isinstance(weight, torch.Tensor) else None
    return (*(_config_value(config, n) for n in (*_SOFTCAPS, *dict(_SCALES), "vocab_size")), where)


def _recipes(config) -> list[_Recipe]:
    """The recipes the check tries, plainest first (a scale of 1 is no scale)."""
    softcaps = [v for v in (_config_value(config, n) for n in _SOFTCAPS) if isinstance(v, (int, float)) and v > 0]
    softcap = float(softcaps[0]) if softcaps else None
    found = [_Recipe(softcap=softcap)]
    if softcap is not None:  # a cap in fp32 differs from one in the head's dtype only for a bf16/fp16 head
        found.append(_Recipe(softcap=softcap, softcap_fp32=True))
    for name, divide in _SCALES:
        value = _config_value(config, name)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value not in (0, 1):
            for where in ("logits", "hidden"):
                found.append(_Recipe(softcap=softcap, scale=float(value), divide=divide, where=where))
    found.append(_Recipe(softcap=softcap, num_items=False))
    found.append(_Recipe(softcap=softcap, loss_kwargs_to_body=False))
    found.append(_Recipe(softcap=softcap, shift=False))
    return found


def _loss(call: _Call, recipe: _Recipe, probe=None):
    """The body's output and ``ForCausalLMLoss`` of it, without the logits. ``probe`` (the check) may replace
    the hidden states where the stock head's linear layer would receive them."""
    body_args = call.body_args
    if not recipe.loss_kwargs_to_body:
        body_args = {k: v for k, v in body_args.items() if k not in _LOSS_KWARGS}
    outputs = call.body(**body_args)
    hidden = outputs.last_hidden_state
    if call.pre_head is not None:
        hidden = _through(call.pre_head, call.head, hidden)
    if hidden.dtype != call.head.weight.dtype and not torch.is_autocast_enabled(hidden.device.type):
        # a body whose hidden states come out in another dtype than its head's (Mamba's fp32 residual stream before a
        # bf16 head): outside autocast stock's head can only take them cast to its dtype (linear takes one dtype),
        # and so does the chunked loss; the check compares what the head receives, so a head that did otherwise
        # stays stock
        hidden = hidden.to(call.head.weight.dtype)
    if recipe.where == "hidden":
        hidden, bias = recipe.head_input(hidden, call.head.bias)
        if probe is not None:
            hidden = probe(hidden)
    else:
        if probe is not None:
            hidden = probe(hidden)
        hidden, bias = recipe.head_input(hidden, call.head.bias)
    if not recipe.shift:  # the head's own CrossEntropyLoss: labels as given, the mean, no keyword honoured
        return fused_linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), call.head.weight,
                                          call.labels.reshape(-1).to(hidden.device), bias, softcap=recipe.softcap,
                                          softcap_in_fp32=recipe.softcap_fp32), outputs
    shift_labels = call.shift_labels
    if shift_labels is None:
        labels = F.pad(call.labels, (0, 1), value=call.ignore_index)
        shift_labels = labels[..., 1:].contiguous()
    shift_labels = shift_labels.reshape(-1).to(hidden.device)
    num_items = call.num_items if recipe.num_items else None
    reduction = "sum" if num_items is not None else "mean"
    if torch.is_tensor(num_items):
        num_items = num_items.to(hidden.device)
    # (ForCausalLMLoss's ``loss / num_items_in_batch`` inside the Function: a frozen head's input gradient, formed
    # in its forward, then divides as stock's backward does)
    loss = fused_linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), call.head.weight, shift_labels,
                                      bias, ignore_index=call.ignore_index, reduction=reduction,
                                      softcap=recipe.softcap, softcap_in_fp32=recipe.softcap_fp32, divisor=num_items)
    return loss, outputs


# -- what the check learnt -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Verified:
    """A head whose chunked path gave stock's numbers, and how to build stock's output."""

    output: type  # the ModelOutput class stock returns
    fields: tuple[str, ...]  # its fields (besides loss and logits) the body's output has under the same name
    missing: tuple[str, ...]  # its fields the body's output lacks (a MoE's aux_loss): computed by the head
    seen: frozenset  # the body output fields set in the check
    recipe: _Recipe = _PLAIN
    modifiers: tuple = ()  # _modifiers(module) when checked
    refuses_num_items: bool = False  # stock raises when given num_items_in_batch: such calls run stock

    def unreproducible(self, outputs) -> list[str]:
        """Body fields this call set that the check did not see, where the head may compute more from them."""
        if not self.missing:
            return []
        return sorted(set(outputs.keys()) - self.seen - _HARMLESS)

    def asked_for_more(self, body_args: dict, config) -> str | None:
        """Why this call asks the body for an output the check did not see and the head may compute more from (a
        MoE's ``output_router_logits=True``, by keyword or set on the config after the check), or None. Decided
        before the body runs, from the call's ``output_*`` flags; :meth:`unreproducible` is the net behind it."""
        if not self.missing:
            return None
        flags = {n for n in body_args if n.startswith("output_")} | {"output_router_logits"}
        for flag in sorted(flags):
            value = body_args.get(flag)
            if value is None:
                value = _config_value(config, flag)
            field = flag[len("output_"):]
            if value is True and field not in self.seen and field not in _HARMLESS:
                return (f"the call asks for {flag}=True, from which the head computes more than the chunked path "
                        f"reproduces (a MoE router's auxiliary loss)")
        return None

    def build(self, loss, outputs, return_dict: bool):
        out = self.output(loss=loss, logits=None, **{n: getattr(outputs, n, None) for n in self.fields})
        if return_dict:
            return out
        # A tuple with stock's positions: ModelOutput.to_tuple() drops None fields, so the absent logits would have
        # shifted every later field down one (`loss, logits, cache = out` unpacked the cache as the logits). The
        # logits' slot holds None, as the ModelOutput's logits field does.
        return tuple(value for name, value in ((f.name, getattr(out, f.name)) for f in dataclasses.fields(out))
                     if value is not None or name == "logits")


#: (stock class, config, dtype and device type, module structure) -> what the check found
_CHECKS: dict[tuple, _Verified | str] = {}
#: the module attribute (in its __dict__) holding its check result: a module's config key is computed once
_CHECKED = "_slimgrad_chunked_check"


class _CheckOf:
    """A module's check result, held in the module's ``__dict__``. dynamo reads a traced module's attribute as a
    constant, where the WeakKeyDictionary this replaced got guards on the dictionary's entries by position: a
    model dropped and collected while another was traced broke them (IndexError under torch.compile). A copy of
    the module (deepcopy, pickling) starts unchecked, as a new module did."""

    __slots__ = ("result",)

    def __init__(self, result=None):
        self.result = result

    def __deepcopy__(self, memo):
        return _CheckOf()

    def __reduce__(self):
        return _CheckOf, ()


def _recalled(module):
    holder = module.__dict__.get(_CHECKED)
    return None if holder is None else holder.result


def _forget(module) -> None:
    module.__dict__.pop(_CHECKED, None)


def _key(module, stock):
    config = getattr(module, "config", None)
    try:
        values = config.to_dict()
        for name in ("_name_or_path", "transformers_version", "architectures"):
            values.pop(name, None)
        text = json.dumps(values, sort_keys=True, default=repr)
    except Exception:  # noqa: BLE001 - an odd config: checked per config object
        text = f"id:{id(config)}"
    try:
        head = module.get_output_embeddings()
        where = (head.weight.dtype, head.weight.device.type, bool(head._forward_hooks or head._forward_pre_hooks))
    except Exception:  # noqa: BLE001
        where = None
    # the module's structure too: the same config with a LoRA-wrapped head, say, is another case
    structure = hash(tuple(ORIGINALS.get(type(m), type(m)) for m in module.modules()))
    return stock, text, where, structure


def _from_trl(forward) -> bool:
    """Whether an instance forward is TRL's (``add_fused_lm_head``): it computes the loss itself, in tiles, and calls
    the class's forward only with its fused head off, so reaching that forward (:func:`reaches`) does not make it a
    plain wrapper such as accelerate's mixed-precision one."""
    func = getattr(forward, "__func__", forward)
    code = getattr(func, "__code__", None)  # (functools.wraps copies the model's __module__ onto it)
    return code is not None and f"{os.sep}trl{os.sep}" in code.co_filename


def check(module) -> _Verified | str:
    """The check's result for ``module`` (run on first use, then cached per class, config and dtype): a
    :class:`_Verified`, or the reason the chunked path is not used for it."""
    own = module.__dict__.get("forward")
    if own is not None and (_from_trl(own) or not reaches(own, type(module).forward)):
        from slimgrad.measure import offloaded_by_accelerate

        if getattr(module, "_hf_hook", None) is not None and offloaded_by_accelerate(module):
            return _OFFLOADED  # (the TRL reason was given before: the model-loading sweep)
        return _PATCHED  # per module, never cached: the class may be fine elsewhere
    result = _recalled(module)
    if result is None:
        if _cannot_check_here(module):
            return _FAKE  # never cached: the real model is checked on its next plain call
        stock = ORIGINALS.get(type(module), type(module))
        key = _key(module, stock)
        result = _CHECKS.get(key)
        if result is None:
            with _apart_from_the_callers_step():
                result = _CHECKS[key] = _run_check(module, stock)
            if isinstance(result, str):
                _notices.record_class_gap(stock, library="transformers", family=FAMILY, reason=result)
            else:
                _notices.forget_class_gap(stock)
        if not (isinstance(result, str) and result.startswith(_META)):
            module.__dict__[_CHECKED] = _CheckOf(result)
    return result


def _recalled_if_current(module):
    """The module's recalled verdict, or None where there is none or the config or head changed since it."""
    verified = _recalled(module)
    if isinstance(verified, _Verified) and verified.modifiers != _modifiers(module):
        verified = None  # the config changed since the check: check again (compiled: run stock)
        _forget(module)
    return verified


def check_heads(model: nn.Module) -> None:
    """Check every chunked head in ``model`` now, on its real tensors, as its next call would (slimgrad.estimate calls
    it before simulating a step on fake tensors, where the check cannot run)."""
    for m in model.modules():
        if type(m).__module__ == __name__ and type(m) in ORIGINALS and _recalled_if_current(m) is None:
            check(m)


def _cannot_check_here(module) -> bool:
    """Whether the check cannot run in this call's context, which a failure would then be cached for: the module's
    tensors are fake (slimgrad.estimate's simulated step, a fake-tensor trace: the check compares real numbers; it
    failed there with DataDependentOutputException, and every later real step ran stock's head, warning of an
    exception the user never caused: the model-loading sweep), a torch.func transform is active (its buffers'
    restoring copy_ raised out of the user's step), or inference mode is on (an estimate called inside it; the
    review sweep)."""
    from torch._subclasses.fake_tensor import FakeTensor

    if torch.is_inference_mode_enabled() or torch._C._functorch.peek_interpreter_stack() is not None:
        return True
    return any(isinstance(t, FakeTensor) for t in itertools.chain(module.parameters(), module.buffers()))


@contextlib.contextmanager
def _apart_from_the_callers_step():
    """The check runs inside the caller's forward on its first call: its tiny graphs are kept from the caller's
    saved-tensor hooks (``SavedTensors`` counted them: 2.36x stock's bytes on that step, the model-loading sweep) and
    its ops from the caller's dispatch modes (a FLOP counter, a debug mode)."""
    from torch.utils._python_dispatch import _disable_current_modes

    with contextlib.ExitStack() as stack:
        stack.enter_context(_disable_current_modes())
        try:
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(_detached, _same))
        except RuntimeError:  # saved-tensor hooks disabled here (torch.func): none of the caller's to hide from
            pass
        yield


def _detached(t):
    # (not ``t`` itself: a saved output would then hold its own node, a cycle that kept the check's graphs, and with
    # them a parameter's stale gradient accumulator, alive after resize_token_embeddings: "EmbeddingBackward0
    # returned an invalid gradient ... [136, 32] but expected ... [128, 32]" on the next step)
    return t.detach()


def _same(t):
    return t


# -- the behavioural check -------------------------------------------------------------------------------------

_META = "its parameters are on the meta device"
_OFFLOADED = ("accelerate offloads its weights (cpu_offload, disk_offload, or a device_map with 'cpu' or 'disk' "
              "entries): its hooks load each module's weights for that module's forward, and the chunked loss reads "
              "the output embedding's weight outside it")
_FAKE = ("the check cannot run in this call (fake tensors: slimgrad.estimate's simulated step or a fake-tensor "
         "trace; a torch.func transform; inference mode); it runs on the next plain training call")
_PATCHED = ("its forward is replaced on the instance (TRL's add_fused_lm_head under its SFT, DPO, KTO, GRPO or RLOO "
            "trainer, or another patch), so "
            "the class forward slimgrad would replace is not the one called; TRL's fused head already computes the "
            "loss without the logits")


def _tolerance(dtype) -> float:
    """Relative tolerance: a few roundings of ``dtype`` (the chunked sums run in another order than stock's)."""
    eps = torch.finfo(dtype).eps if dtype.is_floating_point else 2.0 ** -23
    return max(8 * eps, 2e-5)


def _close(a, b, rtol: float) -> bool:
    if torch.is_tensor(a) and torch.is_tensor(b):
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if not a.is_floating_point():
            return torch.equal(a, b)
        a, b = a.double(), b.double()
        scale = b.abs().max().item() if b.numel() else 0.0
        return bool(torch.allclose(a, b, rtol=rtol, atol=rtol * scale + 1e-30))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_close(x, y, rtol) for x, y in zip(a, b))
    return type(a) is type(b)  # caches and other objects: same kind is all that is asked


class _Seeded:
    """Forks the RNG of the CPU and of the model's device, and seeds both identically for each run."""

    def __init__(self, device: torch.device):
        self.device = device

    def __call__(self, seed: int):
        device = self.device
        forked = [device.index or 0] if device.type not in ("cpu", "meta") else []
        fork = torch.random.fork_rng(devices=forked, device_type=device.type if forked else "cuda")

        class _Ctx:
            def __enter__(ctx):
                fork.__enter__()
                torch.random.default_generator.manual_seed(seed)
                if forked:
                    backend = torch.get_device_module(device.type)
                    with backend.device(device):
                        backend.manual_seed(seed)

            def __exit__(ctx, *exc):
                return fork.__exit__(*exc)

        return _Ctx()


def _run_check(module, stock) -> _Verified | str:
    try:
        head = module.get_output_embeddings()
        tensors = [*module.parameters(), *module.buffers()]
    except Exception as e:  # noqa: BLE001
        return f"reading its output embedding raised {type(e).__name__}: {str(e)[:160]}"
    if any(t.is_meta for t in tensors):
        return _META + ": the check cannot run there (convert the loaded model to use chunked_loss)"
    if not isinstance(head, nn.Module) or not isinstance(getattr(head, "weight", None), torch.Tensor):
        return f"its output embedding is {type(head).__name__}, not a linear layer"
    if head.weight.dim() == 2 and head.weight.shape[0] <= head.weight.shape[1]:
        # (byte- or nucleotide-level vocabularies, RemBERT's 1664-wide head input): the chunked loss keeps the hidden
        # states, which are then no smaller than the logits stock keeps (1.14-1.34x stock's bytes measured)
        return (f"its vocabulary ({head.weight.shape[0]}) is no larger than its output embedding's input "
                f"({head.weight.shape[1]}): the logits stock keeps are no bigger than the hidden states the chunked "
                f"loss would keep")
    flags = [(m, m.training) for m in module.modules()]
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    # bitsandbytes' 4-bit layers repack their weight for its CPU inference kernel on an eval forward whose input
    # needs no grad (CPUs with AVX512-BF16): new data, absmax cast to bf16 in the same quant state, and every later
    # training step computed otherwise than stock's (a QLoRA loss 4.845902 against 4.845938). The check's eval
    # forward did that: the weights' data and quant states are put back as they were (references, no copies)
    quantized = [(p, p.data, q, dict(vars(q))) for p in module.parameters()
                 if (q := getattr(p, "quant_state", None)) is not None and hasattr(q, "__dict__")]
    try:
        with torch.enable_grad():
            return _compare_all(module, stock, head)
    except Exception as e:  # noqa: BLE001 - any failure means: leave it to stock, with the reason
        return f"the check on a tiny batch raised {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    finally:
        for m, flag in flags:
            m.training = flag
        with torch.no_grad():
            for b, value in buffers:
                b.copy_(value)
        for p, data, state, attributes in quantized:
            p.data = data
            p.quant_state = state
            vars(state).clear()
            vars(state).update(attributes)


def _compare_all(module, stock, head) -> _Verified | str:
    sig = _signature(stock)
    takes_any = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
    device = head.weight.device
    embeddings = module.get_input_embeddings() if hasattr(module, "get_input_embeddings") else None
    vocab = min(head.out_features, getattr(embeddings, "num_embeddings", head.out_features) or head.out_features)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, CHECK_TOKENS), generator=g).to(device)
    labels = ids.clone()
    labels[0, CHECK_TOKENS // 2] = -100
    call = {"input_ids": ids, "labels": labels}
    body = _body(module, head)
    body_params = _signature(type(body)).parameters.values() if body is not None else ()
    if "use_cache" in sig.parameters or (takes_any and any(p.name == "use_cache" or p.kind is p.VAR_KEYWORD
                                                           for p in body_params)):
        call["use_cache"] = False  # where stock or its body takes it (transformers 4.x OpenAI GPT takes neither)
    if _config_value(module.config, "output_router_logits") is True and (
            "output_router_logits" in sig.parameters or takes_any):
        # a MoE configured to add its router's auxiliary loss: the check verifies the calls that turn it off
        # (output_router_logits=False); the others run stock, said as such (Verified.asked_for_more). Checked with
        # the config's True, the aux loss made the check refuse the head with a reason that named something else
        call["output_router_logits"] = False
    seeded = _Seeded(device)
    rtol = _tolerance(head.weight.dtype)
    first = None
    for recipe in _recipes(module.config):
        result = _compare_recipe(module, stock, head, call, seeded, rtol, recipe, takes_any)
        if not isinstance(result, str) or not result.startswith(_NUMBERS):
            return result
        first = first or result  # numbers differ: a scale the config names may explain them
    return first[len(_NUMBERS):]


_NUMBERS = "numbers: "


def _compare_recipe(module, stock, head, call, seeded, rtol, recipe, takes_any) -> _Verified | str:
    verified = None
    for training in (True, False):
        module.train(training)
        result = _compare(module, stock, head, call, seeded, rtol, recipe, grads=True)
        if isinstance(result, str):
            return f"{result} ({'training' if training else 'eval'} mode)"
        verified = verified or result
    if (recipe.softcap is not None and recipe.scale is None and head.weight.dtype == torch.float32
            and not _caps_as_stock_under_autocast(module, stock, head, call, seeded, recipe)):
        return _NUMBERS + "under autocast its soft-capped logits are not this recipe's (the cap runs in another dtype)"
    if takes_any:
        module.train(True)
        with_items = {**call, "num_items_in_batch": torch.tensor(float(CHECK_TOKENS + 3), device=head.weight.device)}
        try:
            result = _compare(module, stock, head, with_items, seeded, rtol, recipe, grads=False)
        except Exception as e:  # noqa: BLE001
            try:
                with seeded(0), torch.no_grad():
                    stock.forward(module, **with_items)
            except Exception:  # noqa: BLE001 - stock refuses the keyword: so will we (stock runs such calls)
                return dataclasses.replace(verified, refuses_num_items=True)
            return _NUMBERS + f"the chunked path raised {type(e).__name__} where stock did not"
        if isinstance(result, str):
            return f"{result} (with num_items_in_batch)"
    return verified


def _capped_as_stock(head, hidden, recipe, logits) -> bool:
    """Whether ``recipe``'s soft cap of the head's linear on ``hidden`` gives stock's logits bit for bit."""
    if logits is None:
        return True  # nothing to tell them apart by: the tolerance decides
    with torch.no_grad():
        z = F.linear(hidden, head.weight, head.bias)
        if recipe.softcap_fp32:
            z = z.float()
        z = torch.tanh(z / recipe.softcap) * recipe.softcap
    return z.dtype == logits.dtype and torch.equal(z, logits.detach())


def _caps_as_stock_under_autocast(module, stock, head, call, seeded, recipe) -> bool:
    """Whether ``recipe`` caps an fp32 head's logits as stock does under bf16 autocast (``Trainer(bf16=True)``).
    In fp32 a cap in the head's dtype and one after an fp32 upcast are the same numbers, so the fp32 check took
    Gemma's recipe for Beam, which caps after the upcast: under autocast its gradients were 2.3 % off stock's.
    Stock's logits there, made by the same linear on the same hidden states, tell the two apart bit for bit."""
    seen = {}

    def pre_hook(mod, args):
        seen["hidden"] = args[0].detach()

    device = head.weight.device.type
    with seeded(0), torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16):
        handle = head.register_forward_pre_hook(pre_hook)
        try:
            expected = stock.forward(module, **call)
        except Exception:  # noqa: BLE001 - a model that cannot run under autocast here: nothing to tell apart by
            return True
        finally:
            handle.remove()
        logits = getattr(expected, "logits", None)
        if "hidden" not in seen or not isinstance(logits, torch.Tensor):
            return True
        return _capped_as_stock(head, seen["hidden"], recipe, logits)


def _compare(module, stock, head, call, seeded, rtol, recipe, grads: bool) -> _Verified | str:
    plan = _plan(module, stock, (), call)
    if not isinstance(plan, _Call):
        return plan or "the chunked path declined the check's call"
    scale = {}

    def leaf(x):
        if "k" not in scale:  # logits of a few units, so that a scaled or soft-capped head shows in the numbers
            with torch.no_grad():
                std = F.linear(x, head.weight, head.bias).float().std().item()
            scale["k"] = 4.0 / std if std > 0 and std == std else 1.0
        return (x.detach() * scale["k"]).requires_grad_()

    leaves = {}

    def pre_hook(mod, args):
        leaves["stock"] = leaf(args[0])
        return (leaves["stock"], *args[1:])

    with seeded(0):
        handle = head.register_forward_pre_hook(pre_hook)
        try:
            expected = stock.forward(module, **call)
        finally:
            handle.remove()
    if isinstance(expected, tuple) or not hasattr(expected, "keys"):
        return "its stock forward returned a tuple (config.return_dict is False?), not a ModelOutput"
    if getattr(expected, "loss", None) is None or "stock" not in leaves:
        return "its stock forward computed no loss through its output embedding"

    def probe(hidden):
        leaves["slim"] = leaf(hidden)
        return leaves["slim"]

    with seeded(0):
        loss, outputs = _loss(plan, recipe, probe)
    if expected.loss.dtype != loss.dtype:
        # (BART's family, XLNet, ... in bf16: cross-entropy on bf16 logits, a bf16 loss; the chunked loss sums in
        # fp32, closer to the true value but 0.3 % off stock's there, and its gradients with it)
        return (_NUMBERS + f"its stock loss is computed in {expected.loss.dtype} (on logits of that dtype), the "
                f"chunked loss in {loss.dtype}")
    if leaves["stock"].shape != leaves["slim"].shape or not _close(leaves["slim"], leaves["stock"], rtol):
        return (_NUMBERS + "the hidden states reaching its output embedding differ from its body's output (the "
                "head transforms them)")
    if (recipe.softcap is not None and recipe.scale is None and head.weight.dtype in (torch.bfloat16, torch.float16)
            and not _capped_as_stock(head, leaves["slim"], recipe, getattr(expected, "logits", None))):
        # a bf16 head's loss and gradients are within the tolerance whichever dtype caps (Beam, capped in fp32,
        # passed as Gemma's cap with gradients 1.9 % off): the logits, made by the same linear, tell them apart
        return _NUMBERS + "its soft-capped logits are not this recipe's (the cap runs in another dtype)"
    if not _close(loss.detach().reshape(()), expected.loss.detach().reshape(()).to(loss.dtype), rtol):
        return (_NUMBERS + f"the chunked loss {loss.item():.6g} differs from stock's {expected.loss.item():.6g} (the "
                f"head post-processes its logits in a way its config does not name, or its loss is not the plain "
                f"causal-LM loss)")
    if grads:
        (want,) = torch.autograd.grad(expected.loss, leaves["stock"], allow_unused=True)
        (have,) = torch.autograd.grad(loss, leaves["slim"], allow_unused=True)
        if want is None or have is None or not _close(have, want, rtol):
            return _NUMBERS + "the gradient reaching the hidden states differs from stock's"
    names = [f.name for f in dataclasses.fields(expected)] if dataclasses.is_dataclass(expected) else list(expected)
    body_names = (set(f.name for f in dataclasses.fields(outputs)) if dataclasses.is_dataclass(outputs)
                  else set(outputs.keys()))
    fields = tuple(n for n in names if n not in ("loss", "logits") and n in body_names)
    missing = tuple(n for n in names if n not in ("loss", "logits") and n not in body_names)
    for name in expected.keys():
        if name in ("loss", "logits"):
            continue
        if name in missing:
            return f"its stock output has {name!r}, which its body's output does not give"
        if not _close(getattr(outputs, name, None), expected[name], rtol):
            return f"its stock output's {name!r} differs from its body's"
    return _Verified(type(expected), fields, missing, frozenset(outputs.keys()), recipe, _modifiers(module))


# -- the replacement forward -----------------------------------------------------------------------------------


def _forward(self, *args, **kwargs):
    # Takes anything and binds with the stock signature itself (_plan); register_forward gives each class's
    # copy of it the stock forward's signature, so Trainer's column dropping sees the stock parameters.
    stock = ORIGINALS[type(self)]
    plan = _plan(self, stock, args, kwargs)
    if isinstance(plan, str):
        _decline(stock, plan)
    elif plan is not None:
        verified = _recalled_if_current(self)
        if verified is None and not torch.compiler.is_compiling():
            verified = check(self)
        if not isinstance(verified, _Verified):
            _decline(stock, verified or "the module was not checked (first seen under torch.compile)")
        elif plan.num_items is not None and verified.refuses_num_items:
            pass  # stock raises its own error
        elif (more := verified.asked_for_more(plan.body_args, self.config)) is not None:
            _decline(stock, more)  # said before the body runs: running it twice drew dropout twice, kept two graphs
        elif _logits_cost_less(plan):
            pass  # a size decision, not a gap: stock's forward, with its logits
        else:
            loss, outputs = _loss(plan, verified.recipe)
            extra = verified.unreproducible(outputs)
            if not extra:
                return verified.build(loss, outputs, plan.return_dict)
            _decline(stock, f"the body returned {extra}, from which the head computes more than the chunked path "
                            f"reproduces (a MoE router's auxiliary loss?)")
    return stock.forward(self, *args, **kwargs)


#: whether a call whose trained head costs more chunked than stock's logits runs stock (:func:`_logits_cost_less`);
#: the chunked path's own tests turn it off to run that path on tiny models
CHOOSE_BY_SIZE = True
#: how many bytes of stock's logits past the first chunk must stand against each byte of the gradient buffer (2.0
#: let fp32 at 1x171 tokens peak 1.17x stock's: the full fine-tuning sweep)
SWITCH_FACTOR = 1.0


def _logits_cost_less(plan: _Call) -> bool:
    """Whether stock's full logits cost fewer bytes than the chunked loss here. Where the output embedding trains (full
    fine-tuning, tied embeddings), the chunked backward sums the head's gradient over its chunks in an fp32
    vocab x hidden buffer (and casts it to a low-precision weight's dtype at the end), alive with each chunk's
    logits; stock's logits, their fp32 copy and log-softmax cost tokens x vocab x (logit bytes + 8). With few tokens
    per call against the hidden size the buffer is the larger: a bf16 Llama (hidden 256, vocab 8192) at 1x64 tokens
    peaked 1.45x stock's (the mixed-precision sweep). Such calls run stock's forward."""
    weight = plan.head.weight
    if not (CHOOSE_BY_SIZE and weight.requires_grad and torch.is_grad_enabled()):
        return False  # no gradient of the head: the chunked loss only drops the logits
    device = weight.device.type
    logit_bytes = (torch.get_autocast_dtype(device).itemsize if torch.is_autocast_enabled(device)
                   else weight.element_size())
    cast_bytes = weight.element_size() if weight.dtype != torch.float32 else 0
    tokens = plan.labels.numel()
    hidden = weight.shape[-1]
    # one chunk covering every token holds stock's logits and the buffer; past it, the logits of the rows beyond the
    # first chunk are what the buffer buys back (measured grid and points: docs/chunked_loss.md, "Per call")
    rows = default_chunk_size(tokens, hidden, weight.shape[0])
    stock_bytes = logit_bytes + 4 + (4 if logit_bytes < 4 else 0)  # logits, their fp32 copy (unless fp32), log-softmax
    return tokens <= rows or SWITCH_FACTOR * (tokens - rows) * stock_bytes <= hidden * (4 + cast_bytes)


def _unsupported_reason(module) -> str | None:
    """convert's hook: run (or recall) the behavioural check; a reason leaves the module as stock."""
    result = check(module)
    return result if isinstance(result, str) else None


# -- registration ----------------------------------------------------------------------------------------------


def _structural_reason(cls) -> str | None:
    """Why ``cls`` cannot have a chunked head whatever its forward does, or None."""
    if getattr(cls, "forward", nn.Module.forward) is nn.Module.forward:
        return "it has no forward"
    if not callable(getattr(cls, "get_output_embeddings", None)):
        return "it has no get_output_embeddings()"
    try:
        _signature(cls)
    except (TypeError, ValueError) as e:
        return f"its forward's signature cannot be read ({e})"
    return None


_SEEN: set[type] = set()


def _is_head(cls) -> bool:
    return cls.__name__.endswith("ForCausalLM") or cls.__name__.endswith("LMHeadModel")


def register_loaded() -> list[type]:
    """Register every causal-LM head class of an already imported transformers modeling module; returns the
    newly registered stock classes. Whether a head's chunked path gives stock's numbers is checked per module
    at convert time (:func:`check`)."""
    added = []
    for _, cls in loaded_transformers_classes():
        if cls in _SEEN or not _is_head(cls):
            continue
        _SEEN.add(cls)
        if cls in REPLACEMENTS:
            continue
        reason = _structural_reason(cls)
        if reason is not None:
            _notices.record_class_gap(cls, library="transformers", family=FAMILY, reason=reason)
            continue
        register_forward(cls, _forward, module=__name__, unsupported_reason=_unsupported_reason, option=FAMILY)
        added.append(cls)
    return added


refresh = register_loaded  # called by slimgrad.integrations.load_available on every convert

for _name in CORE_MODELS:
    try:
        importlib.import_module(f"transformers.models.{_name}.modeling_{_name}")
    except ImportError:  # a transformers without that family
        pass
register_loaded()

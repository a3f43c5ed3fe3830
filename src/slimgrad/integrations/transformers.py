"""A ``transformers`` ``TrainerCallback`` that converts the trainer's model when training begins.

Why a callback: trainers build the model the user trains. TRL's ``SFTTrainer(model, peft_config=...)``
wraps the model with peft inside its constructor, so ``slimgrad.convert`` called by the user beforehand
sees no LoRA layer at all; converting at ``on_train_begin`` sees the model exactly as it will be trained.

Why ``on_train_begin`` is early enough, though the trainer has already set everything up by then:
- the optimizer already exists, but converting is a class swap (``module.__class__ = Replacement``), so
  the optimizer's Parameter objects are the model's parameters before and after;
- gradient checkpointing is already enabled, and it wraps the layers' ``__call__``, which dispatches to the
  swapped class's ``forward`` at every step;
- accelerate/DDP/``torch.compile`` wrappers are unwrapped before converting; the wrapped model shares the
  module instances, and nothing has been traced yet (compile traces at the first forward).
The first training forward runs after ``on_train_begin``, so every step runs converted.

Usage::

    from slimgrad.integrations.transformers import SlimgradCallback
    trainer = SFTTrainer(model, args=..., train_dataset=..., peft_config=LoraConfig(...),
                         callbacks=[SlimgradCallback()])
"""

from __future__ import annotations

import inspect
import logging
import sys
from collections.abc import Collection, Iterable, Iterator

from torch import nn
from transformers import TrainerCallback
from transformers.utils import logging as hf_logging

from slimgrad import _notices
from slimgrad._registry import changes_what_is_kept
from slimgrad.convert import ConversionReport, convert

__all__ = ["SlimgradCallback"]

log = logging.getLogger("slimgrad")
#: under transformers' root logger, so it follows ``TrainingArguments(log_level=...)`` like the trainer's own
hf_log = hf_logging.get_logger("transformers.integrations.slimgrad")

_WRAPPER_ATTRIBUTES = ("module", "_orig_mod")  # DDP / DataParallel / DeepSpeed engine, torch.compile


def _unwrap(model: nn.Module) -> nn.Module:
    """The model inside accelerate/DDP/DataParallel/DeepSpeed/``torch.compile`` wrappers."""
    while _is_wrapper(model):
        model = next(getattr(model, a) for a in _WRAPPER_ATTRIBUTES if isinstance(getattr(model, a, None), nn.Module))
    return model


def _is_wrapper(model: nn.Module) -> bool:
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    known = isinstance(model, (DataParallel, DistributedDataParallel)) or type(model).__name__ in (
        "OptimizedModule", "DeepSpeedEngine", "PipelineEngine")
    return known and any(isinstance(getattr(model, a, None), nn.Module) for a in _WRAPPER_ATTRIBUTES)


def _sft_reads_logits(args) -> bool:
    """Whether ``args`` configure a TRL ``SFTTrainer`` of a release that reads ``outputs.logits`` after a forward
    with labels: before ``trl.trainer.utils.add_fused_lm_head`` (TRL 1.x), its entropy and token-accuracy metrics
    did, so a head returning ``logits=None`` fails there."""
    trl = sys.modules.get("trl")
    if trl is None or args is None:
        return False
    try:
        from trl import SFTConfig
        from trl.trainer import utils as trl_utils
    except ImportError:
        return False
    return isinstance(args, SFTConfig) and not hasattr(trl_utils, "add_fused_lm_head")


def _distillation_computes_its_own_loss(args) -> bool:
    """Whether ``args`` configure TRL's ``DistillationTrainer``, whose training loss never calls the head's forward
    (chunked_loss=True was reported converted there and did nothing, silently: the TRL sweep)."""
    kind = type(args)
    return kind.__name__ == "DistillationConfig" and kind.__module__.startswith("trl")


def _check_convert_options(options: dict) -> None:
    """convert's checks of its options that need no model, run when the callback is built."""
    for name in ("strict", "hold_output"):
        if name in options and not isinstance(options[name], bool):
            raise TypeError(f"SlimgradCallback: '{name}' must be True or False, got {options[name]!r}")
    if options.get("chunked_loss") is not None and not isinstance(options["chunked_loss"], bool):
        raise TypeError(f"SlimgradCallback: 'chunked_loss' must be True, False or None, got "
                        f"{options['chunked_loss']!r}")
    if options.get("dropout") is not None:
        from slimgrad.functional.dropout import check_policy

        check_policy(options["dropout"], source="SlimgradCallback's argument 'dropout'")
    for name in ("include", "exclude"):
        spec = options.get(name)
        if spec is None or isinstance(spec, (str, type)):
            continue
        if not isinstance(spec, Iterable):
            raise TypeError(f"SlimgradCallback: '{name}' must be a module path pattern, a module type or a list of "
                            f"them, got {spec!r}")
        if isinstance(spec, Iterator):  # (a generator: read once here, kept as a list for train begin)
            options[name] = spec = list(spec)
        if isinstance(spec, Collection) and not all(isinstance(i, (str, type)) for i in spec):
            raise TypeError(f"SlimgradCallback: '{name}' entries must be path patterns (str) or nn.Module types, got "
                            f"{spec!r}")


class SlimgradCallback(TrainerCallback):
    """Converts the trainer's model in place with :func:`slimgrad.convert` when training begins.

    Keyword arguments are passed through to ``convert`` (``include=``, ``exclude=``, ``chunked_loss=``,
    ``strict=``: with ``strict=True`` a gap stops training at its start with ``SlimgradGapError``);
    ``inplace=True`` always (the trainer and its optimizer hold this model). Works with ``Trainer`` and
    every trainer built on it that takes ``callbacks=`` (TRL's ``SFTTrainer``, ``DPOTrainer``, ...).

    What it converted is logged on the ``slimgrad`` logger and on transformers' logging (so it follows the
    trainer's ``log_level``); a run in which nothing was converted logs a warning, and so does every gap
    ``convert`` found (a claimed family left as stock, ``chunked_loss`` engaging on nothing): on both loggers.
    ``report`` holds the :class:`~slimgrad.convert.ConversionReport` of the last conversion. Converting again
    (a second ``train()``) is harmless: modules already converted are left as they are, and ``report`` then
    lists only the newly converted ones.

    ``budget=`` (bytes or ``"12GiB"``; per rank) fits one training step into a memory budget at train begin
    with :func:`slimgrad.plan` on the converted model and installs the plan (:attr:`plan`; logged on both
    loggers). The step planned for is ``example=`` (one batch as the model takes it) or else the first
    ``per_device_train_batch_size`` rows of the train dataset through the trainer's collator, on the model's
    device, in the trainer's mixed precision; plan for the longest batch with ``example=`` where lengths vary.
    The optimizer state counted is ``optimizer=`` or the trainer's optimizer (built before train begin in
    transformers 5), else AdamW (SGD for ``optim="sgd"``). Choices made with a budget:

    * Hugging Face's gradient checkpointing (``gradient_checkpointing=True``, TRL's default) recomputes every
      layer; a plan on top would checkpoint twice. The callback turns it off (with a warning) and lets the plan
      checkpoint only the blocks the budget needs: same numbers (both restore the RNG), less recompute.
    * ``use_cache`` is set off in the model's configs for training (a recomputed layer would append to the
      cache twice; transformers does the same under its checkpointing) and restored at train end.
    * A budget no plan meets raises ``ValueError`` at train begin with how far over it is and the smallest
      budget a plan meets.
    * Planning runs forwards on real tensors (to time the blocks) under a forked RNG, so the training's random
      stream is the one it would be without a budget.

    Note: TRL's ``SFTTrainer`` computes its loss with its own chunked LM head (no full logits), calling the
    model's body directly, so ``chunked_loss=True`` changes nothing there; it matters for ``Trainer``.
    """

    def __init__(self, budget=None, example=None, optimizer=None, loss_fn=None, **convert_options):
        if "inplace" in convert_options or "report" in convert_options:
            raise TypeError("SlimgradCallback: 'inplace' and 'report' are fixed (the trainer's model is converted "
                            "in place and the report is kept on the callback); pass only convert's other options")
        known = set(inspect.signature(convert).parameters) - {"model", "inplace", "report"}
        unknown = sorted(set(convert_options) - known)
        if unknown:
            raise TypeError(f"SlimgradCallback: unknown option {unknown[0]!r}; slimgrad.convert takes "
                            f"{', '.join(sorted(known))}")
        if budget is None:
            for name, value in (("example", example), ("optimizer", optimizer), ("loss_fn", loss_fn),
                                ("hold_output", convert_options.get("hold_output") or None)):
                if value is not None:
                    raise ValueError(f"SlimgradCallback: '{name}' is used with 'budget' (a memory budget to plan "
                                     f"for); give a budget too")
        else:
            from slimgrad.estimate import check_optimizer_spec, parse_bytes, split_example

            parse_bytes(budget, "SlimgradCallback: 'budget'")  # a bad budget fails here, not at train begin
            if example is not None:
                try:
                    split_example(example)
                except TypeError as e:
                    raise TypeError(f"SlimgradCallback: {e}") from None
            check_optimizer_spec(optimizer, "SlimgradCallback")
        _check_convert_options(convert_options)  # bad options fail here, not at train begin (data already loaded)
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"SlimgradCallback: 'loss_fn' must be a callable output -> scalar, got "
                            f"{type(loss_fn).__name__}")
        self.convert_options = convert_options
        self.budget = budget
        self.example = example
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.report: ConversionReport | None = None
        self._use_cache: list = []
        self.plan = None  # the slimgrad.plan.MemoryPlan installed at the last train begin (with a budget)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is None:
            raise ValueError("SlimgradCallback: the trainer passed no 'model' to on_train_begin; slimgrad needs "
                             "the model to convert it")
        target = _unwrap(model)
        options = dict(self.convert_options)
        if options.get("chunked_loss") and _sft_reads_logits(args):
            options["chunked_loss"] = False
            _notices.notify(_notices.Gap(
                "trl", _notices.library_version("trl"), "trl.SFTTrainer", "chunked_loss",
                "this TRL's SFTTrainer calls the model with labels and then reads outputs.logits for its metrics "
                "(TRL releases without add_fused_lm_head), which chunked_loss=True leaves None; chunked_loss is "
                "left off for this run, everything else is converted (use_liger_kernel=True is TRL's own chunked "
                "loss there)"), strict=bool(options.get("strict", False)))
        if options.get("chunked_loss") and _distillation_computes_its_own_loss(args):
            _notices.notify(_notices.Gap(
                "trl", _notices.library_version("trl"), "trl.DistillationTrainer", "chunked_loss",
                "TRL's DistillationTrainer computes its loss with its own chunked divergence from the model's body "
                "(the head's forward runs only to generate, without grad), so chunked_loss=True engages on nothing "
                "there; it keeps no full logits either"), strict=bool(options.get("strict", False)))
        _, report = convert(target, inplace=True, report=True, **options)
        self.report = report
        main_process = state is None or getattr(state, "is_local_process_zero", True)
        if main_process:
            self._log(target, report)
        if self.budget is not None:
            # on the model inside DDP/compile wrappers: accelerate puts its autocast forward on that one (before
            # wrapping it), so the simulated step runs in the trainer's mixed precision
            self.plan = self._plan(target, args, kwargs, main_process)
            report.plan = self.plan

    def on_train_end(self, args, state, control, **kwargs):
        for config, value in getattr(self, "_use_cache", ()):  # the configs as the user had them (saved with the model)
            config.use_cache = value
        self._use_cache = []

    # -- budget --------------------------------------------------------------------------------------------

    def _plan(self, target: nn.Module, args, kwargs, main_process: bool):
        """Plan the budget on the converted model and install it; see the class docstring for the choices."""
        import torch

        from slimgrad.plan import apply_plan, caches_turned_off, plan

        hf_checkpointing_was_on = _hf_checkpointing_off(target)
        if hf_checkpointing_was_on and main_process:
            message = ("slimgrad: SlimgradCallback(budget=...) turned off Hugging Face's gradient checkpointing "
                       "(gradient_checkpointing=True / TRL's default), which recomputes every layer: the budget's "
                       "plan checkpoints only the blocks the budget needs (none if keeping less already fits), "
                       "with the same numbers, so checkpointing twice is avoided; without a budget, "
                       "SlimgradCallback leaves it on")
            hf_log.warning("%s", message)
            log.warning("%s", message)
        # The cache as the run without slimgrad has it: Hugging Face's checkpointing turns use_cache off in training
        # (a recomputed layer would append its keys and values to the cache a second time), so where it was on, off;
        # else as it is (a T5 decoder fills its cache in training, and off, stock's own gradients move by fp32
        # roundings: turning it off for every plan made a plan that checkpoints nothing differ from stock). A plan
        # that checkpoints turns it off itself (apply_plan), as Hugging Face's checkpointing would.
        self._use_cache = _use_cache_off(target) if hf_checkpointing_was_on else []
        device = _device_of(target)
        example = self.example if self.example is not None else _example_batch(args, kwargs.get("train_dataloader"))
        example = _to_device(example, device)
        optimizer = self.optimizer if self.optimizer is not None else _trainer_optimizer(args, kwargs.get("optimizer"))
        # planning runs forwards (timed, on real tensors): the training's random stream must not move
        devices = [] if device.type == "cpu" else [device.index or 0]
        with torch.random.fork_rng(devices=devices, device_type="cuda" if device.type == "cpu" else device.type):
            try:
                chosen = plan(target, self.budget, example, optimizer=optimizer, loss_fn=self.loss_fn)
            except ValueError as e:
                if isinstance(optimizer, torch.optim.Optimizer) and "cannot rebuild the optimizer" in str(e):
                    hf_log.warning("slimgrad: %s; the budget is planned with AdamW's state (two fp32 copies of "
                                   "the trainable parameters) instead", e)
                    chosen = plan(target, self.budget, example, optimizer="adamw", loss_fn=self.loss_fn)
                elif self.example is None and not str(e).startswith(_SLIMGRAD_ERRORS):
                    # the model's own refusal (transformers 5's forwards take **kwargs: ORPO's prompt_input_ids, ...
                    # pass unnoticed, and then "You must specify exactly one of input_ids or inputs_embeds")
                    raise ValueError(self._batch_refused(example, e)) from e
                else:
                    raise
            except TypeError as e:
                if self.example is not None:
                    raise
                # a trainer whose batch is not the model's keyword inputs (sentence-transformers' trainers feed
                # anchor_input_ids, positive_input_ids, ... to a loss that calls model(features) per column; GRPO's
                # collator hands a list of prompts)
                raise TypeError(self._batch_refused(example, e)) from e
        fused = _trl_fused_head(target)
        if fused is not None:
            # TRL's trainers (SFT, DPO, KTO, GRPO, RLOO in TRL 1.x) call model(..., fused_lm_head=True) for their loss:
            # the plan simulated the model's own loss, not that head, whose CPU fallback holds about 15 logits-sized
            # fp32 buffers for up to 32768 tokens at a time (a tiny Llama LoRA, vocabulary 4096: DPO's real step
            # peaked 12x over a budget the plan met, KTO 10x, SFT 4.3x; the TRL sweep)
            chosen.notes.append(
                f"TRL computes this trainer's loss with its fused LM head ({type(fused).__name__}.forward(..., "
                f"fused_lm_head=True)), which the plan cannot simulate: the budget covers the model's forward and "
                f"backward, not that loss, and on CPU TRL's fallback for it can put the step several times over the "
                f"budget (measured 4-12x on tiny models); measure a real step (slimgrad.peak_bytes) before relying "
                f"on the budget")
        if not chosen.fits:
            raise ValueError(f"SlimgradCallback(budget={self.budget!r}): no plan meets the budget at train begin "
                             f"(estimated per rank, for a batch of {_shapes(example)}):\n{chosen}")
        apply_plan(target, chosen.actions)
        # the caches a checkpointing plan turned off: back as the user had them at train end (saved with the model)
        known = {id(c) for c, _ in self._use_cache}
        self._use_cache += [(c, True) for c in caches_turned_off(target) if id(c) not in known]
        if main_process:
            message = f"{chosen}\n  planned at train begin for a batch of {_shapes(example)} (per rank)"
            # recompute changes the step's time; a loss the plan cannot see changes its peak
            level = logging.WARNING if chosen.actions or fused is not None else logging.INFO
            hf_log.log(level, "%s", message)
            log.log(level, "%s", message)
        return chosen

    def _batch_refused(self, example, e: BaseException) -> str:
        return (f"SlimgradCallback(budget={self.budget!r}): the model's forward refused this trainer's batch as its "
                f"keyword inputs ({', '.join(map(str, example)) if isinstance(example, dict) else 'a batch'}): {e}. "
                f"Pass example= (the model's inputs for one step: a dict of keyword inputs, a tensor, or a tuple of "
                f"positional inputs) and loss_fn= (its output -> the scalar loss)")

    @staticmethod
    def _log(model: nn.Module, report: ConversionReport) -> None:
        total = sum(changes_what_is_kept(type(m)) for m in model.modules())
        counts: dict[str, int] = {}
        for _, type_name in report.converted:
            counts[type_name] = counts.get(type_name, 0) + 1
        summary = ", ".join(f"{n} {name}" for name, n in sorted(counts.items(), key=lambda kv: -kv[1]))
        message = (f"slimgrad: converted {len(report.converted)} module(s) at train begin"
                   f"{f' ({summary})' if summary else ''}; {total} slimgrad module(s) in the model, "
                   f"{len(report.skipped)} left as stock")
        if report.gaps:
            message += f"; {len(report.gaps)} gap(s) in what slimgrad claims (below)"
        if total == 0:
            hf_log.warning("%s: nothing in this model is a type slimgrad knows", message)
            log.warning("%s: nothing in this model is a type slimgrad knows", message)
        elif report.gaps:
            hf_log.warning("%s", message)
            log.warning("%s", message)
        else:
            hf_log.info("%s", message)
            log.info("%s", message)
        # convert already warned on the slimgrad logger (once per process); the trainer's log gets them every run
        for gap in report.gaps:
            hf_log.warning("%s", gap.message())


# -- budget helpers -----------------------------------------------------------------------------------------


def _hf_checkpointing_off(model: nn.Module) -> bool:
    """Turn Hugging Face's gradient checkpointing off (``TrainingArguments(gradient_checkpointing=True)``, TRL's
    ``SFTConfig`` default), as its own API does; True if it was on."""
    import warnings

    if not any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules()):
        return False
    for name in ("activation_checkpointing_disable", "gradient_checkpointing_disable"):  # transformers 5, 4
        disable = getattr(model, name, None)
        if callable(disable):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # 5.x: gradient_checkpointing_disable is an alias
                disable()
            break
    for m in model.modules():  # a model without the API (or a wrapper that did not forward it): the flags
        if getattr(m, "gradient_checkpointing", False) is True:
            m.gradient_checkpointing = False
    return True


def _use_cache_off(model: nn.Module) -> list:
    """Set ``use_cache=False`` on the model's configs for training; returns [(config, previous value)]."""
    changed = []
    for m in model.modules():
        config = m.__dict__.get("config")
        if config is not None and getattr(config, "use_cache", False) is True and id(config) not in {
                id(c) for c, _ in changed}:
            changed.append((config, True))
            config.use_cache = False
    return changed


def _device_of(model: nn.Module):
    import torch

    for t in (*model.parameters(), *model.buffers()):
        return t.device
    return torch.device("cpu")


#: how slimgrad's own planning errors begin (not the model's refusal of a batch)
_SLIMGRAD_ERRORS = ("estimate:", "plan:", "slimgrad", "convert:")


def _trl_fused_head(model: nn.Module) -> nn.Module | None:
    """The module TRL's ``add_fused_lm_head`` patched (its instance forward takes ``fused_lm_head``), or None."""
    for module in model.modules():
        forward = module.__dict__.get("forward")
        code = getattr(getattr(forward, "__func__", forward), "__code__", None)
        if code is not None and "fused_lm_head" in code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]:
            return module
    return None


def _example_batch(args, dataloader):
    """One training batch as the trainer feeds the model: the first ``per_device_train_batch_size`` rows of
    the train dataloader's dataset through its collator (what removes unused columns, pads and builds labels).
    Not by iterating the dataloader: that would draw the sampler's permutation and move accelerate's state."""
    import itertools

    import torch

    if dataloader is None or not hasattr(dataloader, "dataset") or getattr(dataloader, "collate_fn", None) is None:
        raise ValueError("SlimgradCallback(budget=...): the trainer passed no train_dataloader to on_train_begin "
                         "(transformers before 4.x?); give the batch to plan for: SlimgradCallback(budget=..., "
                         "example=batch)")
    n = getattr(args, "per_device_train_batch_size", None) or getattr(dataloader, "batch_size", None) or 1
    dataset = dataloader.dataset
    if hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__"):
        rows = [dataset[i] for i in range(min(n, len(dataset)))]
    else:  # an iterable dataset: its first rows (its own random state, if any, forked)
        with torch.random.fork_rng(devices=[]):
            rows = list(itertools.islice(iter(dataset), n))
    if not rows:
        raise ValueError("SlimgradCallback(budget=...): the train dataset is empty; nothing to plan for")
    return dataloader.collate_fn(rows)


def _to_device(batch, device):
    import torch
    from torch.utils import _pytree

    if isinstance(batch, dict) or hasattr(batch, "keys"):
        batch = dict(batch)  # a BatchEncoding / BatchFeature: plain keyword inputs
    return _pytree.tree_map_only(torch.Tensor, lambda t: t.to(device), batch)


def _shapes(batch) -> str:
    import torch

    if isinstance(batch, dict):
        return ", ".join(f"{k} {tuple(v.shape)}" for k, v in batch.items() if isinstance(v, torch.Tensor))
    if isinstance(batch, torch.Tensor):
        return str(tuple(batch.shape))
    return ", ".join(str(tuple(v.shape)) for v in batch if isinstance(v, torch.Tensor))


def _trainer_optimizer(args, optimizer):
    """What the estimate counts as optimizer state: the trainer's optimizer (transformers 5 has built it
    before ``on_train_begin``; accelerate's wrapper is looked through), else the kind ``args.optim`` names:
    SGD for ``sgd``, AdamW (two fp32 states per trainable parameter: an upper bound for 8-bit and factored
    optimizers) for everything else."""
    import torch

    while optimizer is not None and isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer  # accelerate's AcceleratedOptimizer
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    name = str(getattr(getattr(args, "optim", None), "value", getattr(args, "optim", "adamw"))).lower()
    return "sgd" if name == "sgd" else "adamw"

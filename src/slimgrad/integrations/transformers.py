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

from torch import nn
from transformers import TrainerCallback
from transformers.utils import logging as hf_logging

from slimgrad import _notices
from slimgrad._registry import ORIGINALS
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

    Note: TRL's ``SFTTrainer`` computes its loss with its own chunked LM head (no full logits), calling the
    model's body directly, so ``chunked_loss=True`` changes nothing there; it matters for ``Trainer``.
    """

    def __init__(self, **convert_options):
        if "inplace" in convert_options or "report" in convert_options:
            raise TypeError("SlimgradCallback: 'inplace' and 'report' are fixed (the trainer's model is converted "
                            "in place and the report is kept on the callback); pass only convert's other options")
        known = set(inspect.signature(convert).parameters) - {"model", "inplace", "report"}
        unknown = sorted(set(convert_options) - known)
        if unknown:
            raise TypeError(f"SlimgradCallback: unknown option {unknown[0]!r}; slimgrad.convert takes "
                            f"{', '.join(sorted(known))}")
        self.convert_options = convert_options
        self.report: ConversionReport | None = None

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
        _, report = convert(target, inplace=True, report=True, **options)
        self.report = report
        if state is None or getattr(state, "is_local_process_zero", True):
            self._log(target, report)

    @staticmethod
    def _log(model: nn.Module, report: ConversionReport) -> None:
        total = sum(type(m) in ORIGINALS for m in model.modules())
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

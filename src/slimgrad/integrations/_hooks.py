"""Whether a fused forward may skip calling a submodule.

Several replacements read a submodule's parameters and run one Function instead of calling the submodule (peft's
LoRA layers read ``lora_A``/``lora_B``/``base_layer``, the gated MLPs their activation, the chunked loss its head).
A hook on that submodule, or a global module hook (``register_module_forward_hook`` and the others, which
``FlopCounterMode`` and ``torch.utils.module_tracker`` use), would then never fire: a backward hook that edits a
gradient would be silently ignored. Where one is registered the stock forward runs. One definition for every
integration, so that each checks backward hooks and global hooks alike (peft's LoRA checked forward hooks only)."""

from __future__ import annotations

from torch import nn

from slimgrad import _notices

__all__ = ["global_module_hooks", "module_hooks"]

_MODULE = nn.modules.module


def module_hooks(m: nn.Module) -> bool:
    """Forward, forward-pre, backward or backward-pre hooks registered on ``m`` itself."""
    return bool(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks)


def global_module_hooks() -> bool:
    """Any module hook registered for every module (``torch.nn.modules.module.register_module_*_hook``); the first
    time one is seen, a warning says that the fused forwards step aside while it is."""
    if not (_MODULE._global_forward_hooks or _MODULE._global_forward_pre_hooks or _MODULE._global_backward_hooks
            or _MODULE._global_backward_pre_hooks):
        return False
    _notices.notify(_GLOBAL, stacklevel=4)
    return True


_GLOBAL = ("slimgrad: a global module hook is registered (torch.nn.modules.module.register_module_*_hook; "
           "FlopCounterMode and torch.utils.module_tracker register them): while it is, slimgrad's fused forwards that "
           "would not call a submodule (peft's LoRA layers, the gated MLPs, the chunked loss) run their stock forward, "
           "so that it sees every module (stock's memory for those layers)")

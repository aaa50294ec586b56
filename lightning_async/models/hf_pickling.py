"""Pickling a Hugging Face model for the processes the spawn launcher starts: Hugging Face's local output-capturing
hooks are removed (it reinstalls them when a forward next records outputs), any other local hook is refused by
name."""

from __future__ import annotations

from torch import nn

__all__ = ["refuse_local_hooks", "strip_output_capturing_hooks"]

_CAPTURING_MODULE = "transformers.utils.output_capturing"  # where Hugging Face's local capture hooks are defined


def _hook_dicts(module: nn.Module):
    return [module._forward_hooks, module._forward_pre_hooks, module._backward_hooks, module._backward_pre_hooks]


def strip_output_capturing_hooks(model: nn.Module) -> int:
    """Remove Hugging Face's output-capturing forward hooks from ``model`` and mark it unhooked, so transformers
    installs them again when a forward next records outputs. Returns how many were removed."""
    removed = 0
    for module in model.modules():
        hooks = module._forward_hooks
        for key in [k for k, fn in hooks.items() if getattr(fn, "__module__", None) == _CAPTURING_MODULE]:
            del hooks[key]
            module._forward_hooks_with_kwargs.pop(key, None)
            module._forward_hooks_always_called.pop(key, None)
            removed += 1
        if getattr(module, "_output_capturing_hooks_installed", False):
            module._output_capturing_hooks_installed = False
    return removed


def refuse_local_hooks(model: nn.Module) -> None:
    """Raise, naming the module and the hook, if a hook on ``model`` is a local function (pickle cannot send it
    to the processes the spawn launcher starts)."""
    for name, module in model.named_modules():
        for hooks in _hook_dicts(module):
            for fn in hooks.values():
                if "<locals>" in getattr(fn, "__qualname__", ""):
                    raise TypeError(
                        f"The module at {name or 'model'!r} has a hook {fn.__qualname__!r} (a local function), which cannot "
                        "be pickled for the processes of the spawn launcher. Remove the hook before trainer.fit, or launch "
                        "with start_method='popen' (the default of AsyncPipelineStrategy; the lightning-async CLI uses it)."
                    )


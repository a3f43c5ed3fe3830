"""Forwards that wrappers installed on a module instance captured, and how a class swap reaches them.

A class swap changes what ``type(module).forward`` is, but a wrapper that captured the class's forward function
before the swap (accelerate's mixed-precision wrapper: ``model.forward = MethodType(convert_outputs_to_fp32(
autocast(Model.forward)), model)``, installed by ``Trainer(bf16=True)`` before ``SlimgradCallback`` converts) goes on
calling the old one: the converted head's chunked loss never ran, and the check blamed TRL. The wrapper chain is
rebuilt with the new function in the old one's place: new function objects (same code, new closure cells) and
shallow copies of callable holders along the path only, so a chain a deep copy shares with its original (``copy``
copies a bound method's instance, not its function) is left as it was for the original.
"""

from __future__ import annotations

import functools
import types

from torch import nn

__all__ = ["reaches", "rewrapped"]

#: how deep a chain is followed: accelerate's is four links (method, fp32 wrapper, its holder object, autocast's)
_DEPTH = 6


def rewrapped(obj, old, new):
    """``obj`` (a wrapper chain) with every reference to ``old`` replaced by ``new``; None if ``old`` is not in it."""
    return _rewrapped(obj, old, new, _DEPTH, {})


def reaches(obj, function) -> bool:
    """Whether the wrapper chain ``obj`` calls ``function`` (holds it within :data:`_DEPTH` links)."""
    return _rewrapped(obj, function, function, _DEPTH, {}) is not None


def _rewrapped(obj, old, new, depth: int, memo: dict):
    if obj is old:
        return new
    if depth == 0 or obj is None or isinstance(obj, (type, nn.Module)):
        return None
    if id(obj) in memo:
        return memo[id(obj)]
    memo[id(obj)] = None  # (a cycle finds nothing)
    result = None
    if isinstance(obj, types.MethodType):
        inner = _rewrapped(obj.__func__, old, new, depth - 1, memo)
        result = None if inner is None else types.MethodType(inner, obj.__self__)
    elif isinstance(obj, functools.partial):
        func = _rewrapped(obj.func, old, new, depth - 1, memo)
        args = [_rewrapped(a, old, new, depth - 1, memo) for a in obj.args]
        if func is not None or any(a is not None for a in args):
            result = functools.partial(func if func is not None else obj.func,
                                       *(a if a is not None else b for a, b in zip(args, obj.args)), **obj.keywords)
    elif isinstance(obj, types.FunctionType):
        result = _rewrapped_function(obj, old, new, depth, memo)
    elif callable(obj) and hasattr(obj, "__dict__"):  # a callable holding the next link (accelerate's fp32 wrapper)
        changed = {}
        for name, value in list(vars(obj).items()):
            if callable(value):
                replaced = _rewrapped(value, old, new, depth - 1, memo)
                if replaced is not None:
                    changed[name] = replaced
        if changed:  # a shallow copy without the copy protocol (accelerate's wrapper refuses to be pickled)
            result = object.__new__(type(obj))
            vars(result).update({**vars(obj), **changed})
    memo[id(obj)] = result
    return result


def _rewrapped_function(fn: types.FunctionType, old, new, depth: int, memo: dict):
    cells = list(fn.__closure__ or ())
    changed = False
    for i, cell in enumerate(cells):
        try:
            content = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        replaced = _rewrapped(content, old, new, depth - 1, memo)
        if replaced is not None:
            cells[i] = types.CellType(replaced)
            changed = True
    wrapped = fn.__dict__.get("__wrapped__")
    replaced_wrapped = _rewrapped(wrapped, old, new, depth - 1, memo) if wrapped is not None else None
    if not changed and replaced_wrapped is None:
        return None
    result = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__,
                                tuple(cells) if fn.__closure__ is not None else None)
    result.__kwdefaults__ = fn.__kwdefaults__
    result.__dict__.update(fn.__dict__)
    result.__qualname__, result.__doc__, result.__module__ = fn.__qualname__, fn.__doc__, fn.__module__
    if replaced_wrapped is not None:
        result.__wrapped__ = replaced_wrapped
    return result

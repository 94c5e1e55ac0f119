"""What a recipe holds of an op's arguments, captured before the op runs.

:func:`capture_args` turns an op's ``(args, kwargs)`` into what a
:class:`~tiermem.tracking.records.Record` holds: a
:class:`~tiermem.tracking.records.Ref` per dense tensor argument (lists of
tensors looked into), every other argument as it is. It runs once per
recomputable op of a tracked forward, so it is written for that: one type
test per plain argument, no call per argument on the common path.
:func:`signature` is what a step following learned positions compares of an
op's arguments.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .records import _STRIDED, Ref, _plain

__all__ = ["capture_args", "signature", "UNSUPPORTED"]

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter

#: Argument types held as they are without a look inside (immutable scalars
#: and torch's own descriptors): the common case, one set lookup each.
_AS_IS = frozenset({int, float, bool, complex, str, type(None), torch.dtype, torch.device,
                    torch.layout, torch.memory_format, torch.SymInt, torch.SymFloat,
                    torch.SymBool})


class _Unsupported:
    """Marks a tensor argument the recompute tier cannot hold (inference
    tensors, sparse or other layouts, tensor subclasses)."""


UNSUPPORTED = _Unsupported()


def ref_of(records: dict, t: torch.Tensor) -> Ref:
    """A :class:`Ref` of ``t`` with ``t``'s record in ``records`` (``id`` ->
    (weak reference, Record), NOTE [Records hold no tensor]), if it has one."""
    hit = records.get(id(t))
    return Ref(t, hit[1] if hit is not None and hit[0]() is t else None)


def _capture(records: dict, a: Any) -> Any:
    """One argument as a record holds it, or :data:`UNSUPPORTED`."""
    ta = type(a)
    if ta in _AS_IS:
        return a
    if ta is _Tensor or ta is _Parameter:
        if a.layout is not _STRIDED or a.is_inference():
            return UNSUPPORTED
        return ref_of(records, a)
    if isinstance(a, _Tensor):   # a subclass
        return UNSUPPORTED
    if isinstance(a, (list, tuple)) and any(isinstance(x, _Tensor) for x in a):
        if not all(_plain(x) for x in a if isinstance(x, _Tensor)):
            return UNSUPPORTED
        return [ref_of(records, x) if isinstance(x, _Tensor) else x for x in a]
    return a


def capture_args(records: dict, args: tuple, kwargs: dict) -> Optional[tuple]:
    """``(args, kwargs)`` as a record holds them (a tuple and a new dict), or
    ``None`` if an argument cannot be held (then the op is not recomputable)."""
    held = []
    append = held.append
    for a in args:
        ta = type(a)
        if ta in _AS_IS:
            append(a)
        elif ta is _Tensor or ta is _Parameter:
            if a.layout is not _STRIDED or a.is_inference():
                return None
            hit = records.get(id(a))
            append(Ref(a, hit[1] if hit is not None and hit[0]() is a else None))
        else:
            if ta is list or ta is tuple:   # sizes, dims: held as they are
                for x in a:
                    if isinstance(x, _Tensor):
                        break
                else:
                    append(a)
                    continue
            c = _capture(records, a)
            if c is UNSUPPORTED:
                return None
            append(c)
    if not kwargs:
        return tuple(held), {}
    held_kw = {}
    for k, v in kwargs.items():
        c = v if type(v) in _AS_IS else _capture(records, v)
        if c is UNSUPPORTED:
            return None
        held_kw[k] = c
    return tuple(held), held_kw


#: Argument types a signature holds as they are (compared by value, never raising).
_SIG_PLAIN = frozenset({int, bool, str, type(None), torch.dtype, torch.device, torch.layout,
                        torch.memory_format})


def signature(args: tuple) -> tuple:
    """What NOTE [Records learned by position] (rule 1) compares of an op's
    arguments: each tensor's shape, ints, strings, dtypes and the like as they
    are, floats unless NaN, lists looked into, and of any other object its type
    (its own ``==`` may raise or compare elementwise)."""
    out = []
    for a in args:
        t = type(a)
        if t in _SIG_PLAIN:
            out.append(a)
        elif t is torch.Tensor or isinstance(a, torch.Tensor):
            out.append(a.shape)
        else:
            out.append(_signature_item(a))
    return tuple(out)


def _signature_item(a: Any) -> Any:
    t = type(a)
    if t is float or t is complex:
        return a if a == a else "nan"
    if t is list or t is tuple:
        return signature(a)
    return t

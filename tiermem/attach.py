"""Attaching an Offloader to a module: :meth:`tiermem.Offloader.attach`.

For training loops we do not own (Hugging Face ``Trainer``, torchtune,
Lightning): ``off.attach(model)`` puts each forward of ``model`` under the
Offloader, as ``with off: out = model(...)`` would, with a forward pre-hook
that enters it and a forward hook registered with ``always_call=True`` that
leaves it when the forward returns or raises. ``detach()`` removes both.
"""

# NOTE [Attaching]
# One forward of the attached module is one step, exactly as ``with off:`` around
# it would be (rules tested in tests/test_attach.py):
# 1. Its saved tensors, stats and backward are the step's; tensors saved outside
#    the module's forward (the loop's loss) are plain autograd's.
# 2. The step is left when the forward returns or raises an Exception
#    (``always_call`` hooks). torch skips them for other BaseExceptions, so each
#    entry holds the frame of the module call: an entry whose frame left this
#    thread's stack belongs to a forward that is over, left at the next hook or
#    at ``detach()``.
# 3. Nothing is entered when the Offloader is already active in this thread (the
#    outer step holds the tensors); other Offloaders nest as contexts do.
# 4. Nothing is entered with grad mode off, nor inside backward.
# 5. Attaching twice to the same Offloader raises; ``detach()`` is idempotent.
# 6. A deep copy or pickle of an attached module carries inert hooks.

from __future__ import annotations

import sys
import threading
import weakref
from typing import List, Optional

import torch

from .errors import TierMemError

__all__ = ["Attachment", "attach_module", "detach_modules"]

_in_backward = torch._C._current_graph_task_id   # -1 outside autograd's engine


class _Entry:
    """One forward of the attached module in progress on a thread."""

    __slots__ = ("frame", "ctx")

    def __init__(self, frame) -> None:
        self.frame = frame      # NOTE [Attaching], rule 2
        self.ctx = None         # what the Offloader's __enter__ gave, if entered


def _live_frames(frame) -> set:
    """ids of ``frame`` and the frames that called it (the thread's stack)."""
    live = set()
    while frame is not None:
        live.add(id(frame))
        frame = frame.f_back
    return live


class Attachment:
    """The hooks that put each forward of one module under one Offloader.

    Made by :meth:`tiermem.Offloader.attach`. ``detach()`` removes the hooks
    (idempotent); ``with off.attach(model): ...`` detaches on the way out.
    ``attached`` says whether the hooks are installed. One forward of the module
    is one step, as ``with off:`` around it would be; nothing is entered when the
    Offloader is already active in this thread, with grad mode off, or inside
    backward.
    """
    # NOTE [Attaching] in attach.py: the rules.

    def __init__(self, offloader, module: torch.nn.Module) -> None:
        self._off = offloader
        self._module = weakref.ref(module)
        self._lock = threading.Lock()
        self._open: dict = {}    # thread id -> [_Entry], innermost last
        self.attached = True
        self._handles = (
            module.register_forward_pre_hook(self._before),
            module.register_forward_hook(self._after, always_call=True),
        )

    @property
    def module(self) -> Optional[torch.nn.Module]:
        """The attached module (``None`` once it was garbage-collected)."""
        return self._module()

    # -- the hooks --------------------------------------------------------------
    def _stack(self) -> List[_Entry]:
        me = threading.get_ident()
        stack = self._open.get(me)
        if stack is None:
            with self._lock:
                stack = self._open[me] = []
        return stack

    def _before(self, module, args) -> None:
        if not self.attached:
            return
        caller = sys._getframe(1)   # the module call's frame: NOTE [Attaching], rule 2
        stack = self._stack()
        if stack:
            self._close_finished(stack, _live_frames(caller), None)
        entry = _Entry(caller)
        stack.append(entry)   # before entering: the forward hook pops it even if that fails
        off = self._off
        if torch.is_grad_enabled() and _in_backward() == -1 and not off._active_here():
            entry.ctx = off.__enter__()   # rules 3 and 4

    def _after(self, module, args, output) -> None:
        if not self.attached:
            return
        stack = self._open.get(threading.get_ident())
        if not stack:
            return   # our pre-hook did not run (one before it raised)
        caller = sys._getframe(1)
        top = stack[-1]
        if top.frame is caller:   # the forward returned
            stack.pop()
            top.frame = None
            if top.ctx is not None:
                top.ctx.__exit__(None, None, None)
            return
        # The forward raised: its entry's frame is over (as is any left by a
        # BaseException in a forward that was called inside it).
        self._close_finished(stack, _live_frames(caller), sys.exc_info())

    @staticmethod
    def _close_finished(stack: List[_Entry], live: set, exc_info) -> None:
        """Leave, innermost first, the entries whose forward is over."""
        exc = exc_info if exc_info is not None and exc_info[0] is not None else (
            TierMemError, TierMemError("tiermem: the attached forward did not return"), None)
        while stack and id(stack[-1].frame) not in live:
            entry = stack.pop()
            entry.frame = None
            if entry.ctx is not None:
                entry.ctx.__exit__(*exc)

    # -- lifetime -------------------------------------------------------------------
    def detach(self) -> None:
        """Remove the hooks; leave the Offloader if a forward of this thread
        left it entered (a forward ended by a KeyboardInterrupt or SystemExit).
        Raises TierMemError, and removes nothing, while the module's forward
        runs in another thread."""
        # NOTE [Attaching], rule 2.
        if not self.attached:
            return
        me = threading.get_ident()
        with self._lock:
            busy = [t for t, s in self._open.items()
                    if t != me and any(e.ctx is not None for e in s)]
        if busy:
            raise TierMemError(
                "tiermem: detach() while the attached module's forward runs under the "
                "Offloader in another thread; detach between forward passes")
        self.attached = False
        for h in self._handles:
            h.remove()
        stack = self._open.get(me) or []
        self._close_finished(stack, set(), None)
        self._open.clear()
        attachments = self._off._attachments
        if self in attachments:
            attachments.remove(self)

    def __enter__(self) -> "Attachment":
        return self

    def __exit__(self, *exc) -> None:
        self.detach()

    # NOTE [Attaching], rule 6: copies of the module get inert hooks.
    def __deepcopy__(self, memo) -> "_Inert":
        return _Inert()

    def __reduce__(self):
        return (_Inert, ())

    def __repr__(self) -> str:
        m = self.module
        what = type(m).__name__ if m is not None else "a collected module"
        return f"<tiermem Attachment of {what} to {self._off!r}, attached={self.attached}>"


class _Inert:
    """What a copied attachment becomes: hooks that do nothing."""

    attached = False

    def _before(self, module, args) -> None:
        return None

    def _after(self, module, args, output) -> None:
        return None


def attach_module(offloader, module: torch.nn.Module) -> Attachment:
    """:meth:`tiermem.Offloader.attach`: checks, then attaches."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"tiermem: attach() takes a torch.nn.Module, got {type(module).__name__}")
    if offloader.closed:
        raise TierMemError("tiermem: attach() on a closed Offloader; make a new Offloader")
    for a in offloader._attachments:
        if a.module is module:
            raise TierMemError(
                f"tiermem: this {type(module).__name__} is already attached to this "
                "Offloader; detach() it first (attach() once per module)")
    att = Attachment(offloader, module)
    offloader._attachments.append(att)
    return att


def detach_modules(offloader, module: Optional[torch.nn.Module] = None) -> None:
    """:meth:`tiermem.Offloader.detach`."""
    attachments = list(offloader._attachments)
    if module is not None:
        attachments = [a for a in attachments if a.module is module]
        if not attachments:
            raise TierMemError(
                f"tiermem: detach(): this {type(module).__name__} is not attached to this "
                "Offloader (detach() without an argument detaches every module)")
    for a in reversed(attachments):
        a.detach()

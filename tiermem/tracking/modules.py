"""The running module, per thread, for :attr:`TensorInfo.module`.

Why not ``torch.utils.module_tracker.ModuleTracker``: its state is one set
shared by all threads, and it installs backward hooks on every module's inputs
(autograd nodes we do not need). tiermem needs only the forward stack, per
thread, and only while a context is active.

Global forward pre/post hooks are installed while a context is active
anywhere or an Offloader holds them (NOTE [Hooks held between steps]); each
thread keeps its own stack of qualified names. A module's qualified name is its
root's class name followed by its path in ``root.named_modules()``
(``TinyGPT.blocks.1.ln1``), computed once per root and cached weakly.
"""

from __future__ import annotations

import threading
import weakref
from typing import Optional

import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.overrides import TorchFunctionMode

from .modestack import (dynamo_ran, is_compiled_module, is_innermost, region, resume,
                        set_region, suspend, take_off)

_lock = threading.Lock()
_users = 0
_handles: list = []
_holders: "weakref.WeakSet" = weakref.WeakSet()   # NOTE [Hooks held between steps]
_names: "weakref.WeakKeyDictionary[torch.nn.Module, str]" = weakref.WeakKeyDictionary()
_tls = threading.local()


def _stack() -> list:
    s = getattr(_tls, "stack", None)
    if s is None:
        s = _tls.stack = []
    return s


def _root_listeners() -> list:
    s = getattr(_tls, "root_listeners", None)
    if s is None:
        s = _tls.root_listeners = []
    return s


def _name_of(module: torch.nn.Module, stack: list) -> str:
    name = _names.get(module)
    if name is not None:
        return name
    if stack:
        parent_mod, parent_name = stack[-1]
        for child_name, child in parent_mod.named_children():
            if child is module:
                name = f"{parent_name}.{child_name}"
                break
        else:  # called from a module it does not belong to (shared/functional use)
            name = f"{parent_name}.<{type(module).__name__}>"
        _names[module] = name
        return name
    root = type(module).__name__
    for sub_name, sub in module.named_modules(remove_duplicate=True):
        if sub not in _names:
            _names[sub] = f"{root}.{sub_name}" if sub_name else root
    return _names[module]


#: True while Dynamo traces (a constant to it: the hooks below trace to nothing).
_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", lambda: False)


def _pre_hook(module: torch.nn.Module, args) -> None:
    # NOTE [Tracker under torch.compile]
    # These are global forward hooks: Dynamo traces them inside every compiled
    # module call, unlike the saved-tensor hooks (hidden from it, NOTE [Hooks
    # under torch.compile] in runtime/hooks.py). Traced, their weak dictionary of
    # names and thread-local stack become guards and mutations of the graph,
    # which broke recompiles (AssertionError "already tracked for mutation";
    # intermittently "dictionary changed size during iteration"). So they do
    # nothing while Dynamo traces: tensors saved by a compiled region are
    # packed after it, by its eager wrapper, and are named by the modules
    # running outside it.
    if _compiling() or not _users:
        return
    reg = region()
    if reg is not None:   # NOTE [Compiled regions run without our modes] in tracking/modestack.py
        reg[1] += is_compiled_module(module)   # one more open, or none
        return
    stack = _stack()
    listeners = getattr(_tls, "root_listeners", None)
    if listeners:
        depth = len(stack)
        for entry_depth, listener in listeners:
            if depth == entry_depth:
                listener(module)
    name = _name_of(module, stack)
    stack.append((module, name))
    if is_compiled_module(module):   # a compiled region starts: modestack.region()
        set_region([len(stack) - 1, 1, suspend()])
        return
    scopes = _tls.__dict__.get("scopes")
    if scopes:   # NOTE [Scoped tracking]
        for s in scopes:
            s.update(name)


def _post_hook(module: torch.nn.Module, args, output) -> None:
    if _compiling() or not _users:   # NOTE [Tracker under torch.compile]
        return
    reg = region()
    if reg is not None:   # NOTE [Compiled regions run without our modes] in tracking/modestack.py
        if not is_compiled_module(module):
            return
        reg[1] -= 1
        if reg[1]:   # a compiled module inside the region ended
            return
        set_region(None)
        resume(reg[2])
    stack = _stack()
    # Pop down to this module (robust against a module that raised inside).
    for i in range(len(stack) - 1, -1, -1):
        if stack[i][0] is module:
            del stack[i:]
            break
    else:
        return
    scopes = _tls.__dict__.get("scopes")
    if scopes:   # NOTE [Scoped tracking]
        name = stack[-1][1] if stack else ""
        for s in scopes:
            s.update(name)


def call_name(func) -> str:
    """The name a torch call is tracked by (``F.linear``: ``"linear"``,
    ``Tensor.__add__``: ``"__add__"``): NOTE [Tracking inside torch calls]
    below. Two functions of one name are one (more tracking, never less)."""
    name = getattr(func, "__name__", None)
    return name if type(name) is str else type(func).__name__


def current_module() -> str:
    """Qualified name of the innermost running module of this thread, ``""`` if none."""
    stack = getattr(_tls, "stack", None)
    return stack[-1][1] if stack else ""


# NOTE [Scoped tracking]
# Exactness does not rest on the scope. Producer tracking is needed only where a
# recipe's ops run, so when that set of modules is known (a plan's
# ``Plan.tracking_scope``, a wrapped block's own run: :func:`track_block`), a
# :class:`TrackingScope` enters the mode only while the innermost running module
# is named in ``names`` (``""``: ops outside every module, such as the loss),
# switching at each module's pre- and post-hook. Every other case (fixed or
# callable policy, a MUST_RECOMPUTE block, a profiled step, the safe order, an
# auto Offloader with ``hints``) tracks the whole forward. An op run outside the
# scope has no record, so a recipe that reaches its output stores that tensor as
# an input or declines (the next tier); the scope changes only which inputs are
# stored (bytes) and which writes the mode sees: a write outside it to a dropped
# tensor is not seen, and a held parameter written there is caught by NOTE
# [Parameters changed before backward] in tracking/params.py. The scope is fixed
# when the step starts, even if the step switches plans.


# NOTE [Tracking inside torch calls]
# Exactness does not rest on the gate, for the reasons of NOTE [Scoped tracking]:
# an op it does not see has no record. Where the profile knows the torch calls
# its recipes' ops ran in (``Record.call`` from a CallRecorder; per module,
# ``Plan.tracking_calls``), the scope enters a :class:`CallGate` (a
# ``TorchFunctionMode``, far fewer calls than ops) instead of the dispatch mode,
# and the gate enters the dispatch mode only for those calls. An op run outside
# every torch call leaves its module tracked whole. Calls are named by
# ``__name__`` (two of one name are both tracked). A function mode sees the
# outermost call only, the same in the profile and the step; a module run inside
# a torch call moves the scope while the gate is out of the stack, and the gate
# stays as it was until the next boundary. See also NOTE [Views made inside
# untracked calls] and NOTE [Calls recorded whole] in tracking/producers.py.

_NOTHING: frozenset = frozenset()
_NO_CALLS: dict = {}

_OFF, _DISPATCH, _GATE = 0, 1, 2


class CallGate(TorchFunctionMode):
    """Runs the torch calls named in ``allowed`` under ``mode`` (a dispatch
    mode, entered for the call's duration unless already active) with
    ``mode.wanted = wanted``, the others as they are. NOTE [Tracking inside
    torch calls]."""

    tiermem_mode = True   # tracking/modestack.py

    def __init__(self, mode) -> None:
        super().__init__()
        self.mode = mode
        self.allowed: frozenset = _NOTHING
        self.wanted: Optional[frozenset] = None
        #: Of ``allowed``, the calls recorded whole, by the op each ran in the
        #: profile (NOTE [Calls recorded whole] in tracking/producers.py).
        self.direct: dict = {}
        #: Calls run under the dispatch mode, and calls recorded whole (tests,
        #: benchmarks).
        self.calls_tracked = 0
        self.calls_direct = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        if _compiling():   # NOTE [Compiled regions run without our modes] in tracking/modestack.py
            return func(*args, **kwargs)
        name = call_name(func)
        if name not in self.allowed:
            return func(*args, **kwargs)
        mode = self.mode
        n = _dispatch_depth()
        if n and _dispatch_at(n - 1) is mode:   # already tracking (nested gates)
            return func(*args, **kwargs)
        op = self.direct.get(name)
        if op is not None and not _any_autocast():   # rule 2 (4: record_call)
            self.calls_direct += 1
            return mode.record_call(func, args, kwargs, op)
        self.calls_tracked += 1
        mode.wanted = self.wanted
        with mode:
            return func(*args, **kwargs)


_dispatch_depth = torch._C._len_torch_dispatch_stack
_any_autocast = torch._C._is_any_autocast_enabled
_dispatch_at = torch._C._get_dispatch_stack_at


class TrackingScope:
    """Enters ``mode`` (a dispatch mode) on this thread only while the innermost
    running module is named in ``names``, or (``blocks``) while a wrapped
    block whose policy recomputes runs. See NOTE [Scoped tracking].
    ``ops``: ``None``, or per module of ``names`` the op names the mode is to
    record there (set as ``mode.wanted`` at each module boundary; every
    recomputable op inside a block): NOTE [Recording only what recipes use]
    in tracking/producers.py. ``calls``: ``None``, or per module of ``names`` the
    names of the torch calls to track in (``None`` for a module: all of it);
    in such a module a :class:`CallGate` is entered instead of the mode:
    NOTE [Tracking inside torch calls]. ``direct``: per module, of its
    ``calls``, those recorded whole without the mode, by the op each ran in
    the profile (NOTE [Calls recorded whole] in tracking/producers.py). ModuleStack runs it."""

    __slots__ = ("mode", "names", "blocks", "state", "entries", "in_blocks", "ops", "calls",
                 "direct", "gate")

    def __init__(self, mode, names=frozenset(), blocks: bool = False,
                 ops: Optional[dict] = None, calls: Optional[dict] = None,
                 direct: Optional[dict] = None) -> None:
        self.mode = mode
        self.names = frozenset(names)
        self.blocks = blocks
        self.ops = ops
        self.calls = calls
        self.direct = direct or {}
        #: The gate of ``calls`` (``None``: no module is tracked by calls).
        self.gate = (CallGate(mode) if calls and any(v is not None for v in calls.values())
                     else None)
        #: What is entered now: _OFF, _DISPATCH (the mode) or _GATE.
        self.state = _OFF
        #: Times the mode or the gate was entered (tests, benchmarks).
        self.entries = 0
        #: Wrapped blocks that recompute running now (nested ones count each).
        self.in_blocks = 0

    @property
    def active(self) -> bool:
        """Whether the mode or the gate is entered now."""
        return self.state != _OFF

    def update(self, innermost: str) -> None:
        """The innermost running module is now ``innermost`` (``""``: none)."""
        if self.in_blocks > 0:
            target = _DISPATCH
            self.mode.wanted = None
        elif innermost in self.names:
            ops = self.ops
            wanted = None if ops is None else ops.get(innermost, _NOTHING)
            allowed = None if self.gate is None else self.calls.get(innermost)
            if allowed is None:
                target = _DISPATCH
                self.mode.wanted = wanted
            else:
                target = _GATE
                gate = self.gate
                gate.allowed, gate.wanted = allowed, wanted
                gate.direct = self.direct.get(innermost, _NO_CALLS)
        else:
            target = _OFF
        if target == self.state:
            return
        self.leave()
        if self.state != _OFF:   # another mode above ours: left at a later boundary
            return
        if target == _DISPATCH:
            self.mode.__enter__()
        elif target == _GATE:
            self.gate.__enter__()
        else:
            return
        self.state = target
        self.entries += 1

    def leave(self, force: bool = False) -> None:
        """Leave the mode (or the gate) if it is entered and the innermost mode
        of its kind (one entered inside the scope and not left there stays
        above it: ours is then left at the next module boundary, or at the
        context's exit, ``force``)."""
        state = self.state
        if state == _OFF:
            return
        function = state == _GATE
        ours = self.gate if function else self.mode
        if not force and not is_innermost(ours, function):
            return
        self.state = _OFF
        take_off(ours, function)   # nothing popped if it is not on the stack

    def close(self) -> None:
        """Leave whatever is entered (the context exits)."""
        self.leave(force=True)


def track_block():
    """A wrapped block whose policy recomputes starts: the scopes of this
    thread that follow blocks track until :func:`untrack_block` (given what
    this returns) is called at its end."""
    scopes = _tls.__dict__.get("scopes")
    if not scopes:
        return ()
    entered = [s for s in scopes if s.blocks]
    for s in entered:
        s.in_blocks += 1
        s.update("")
    return entered


def untrack_block(entered) -> None:
    name = current_module()
    for s in entered:
        s.in_blocks -= 1
        s.update(name)


class ModuleStack:
    """Handle of one user (a context) of the tracker on this thread.

    ``on_root(module)`` is called when a module starts at the depth the stack had
    when the context was entered, i.e. for each outermost module run inside the
    context (used to learn the parameters and buffers of the model).
    ``scope``: a :class:`TrackingScope` followed while the context is active
    (left, if active, when it exits). ``holder``: an object (the Offloader)
    that keeps the hooks installed between its contexts, until it is given to
    :func:`release` or dies: NOTE [Hooks held between steps].
    """

    def __init__(self, on_root=None, scope: Optional[TrackingScope] = None, holder=None) -> None:
        self._on_root = on_root
        self._scope = scope
        self._holder = holder
        self._depth = 0

    def __enter__(self) -> "ModuleStack":
        global _users
        with _lock:
            if not _handles:
                _handles.append(register_module_forward_pre_hook(_pre_hook))
                _handles.append(register_module_forward_hook(_post_hook, always_call=True))
            if self._holder is not None:
                _holders.add(self._holder)
            _users += 1
        self._depth = len(_stack())
        if self._on_root is not None:
            _root_listeners().append((self._depth, self._on_root))
        scope = self._scope
        if scope is not None:
            scopes = _tls.__dict__.get("scopes")
            if scopes is None:
                scopes = _tls.scopes = []
            scopes.append(scope)
            scope.update(current_module())
        return self

    def __exit__(self, *exc) -> None:
        global _users
        if self._scope is not None:
            scopes = _tls.__dict__.get("scopes") or []
            for i in range(len(scopes) - 1, -1, -1):
                if scopes[i] is self._scope:
                    del scopes[i]
                    break
            self._scope.close()   # still active: the ops after the model, a module unfinished
        del _stack()[self._depth:]
        reg = region()
        if reg is not None and reg[0] >= self._depth:   # left inside a compiled module
            set_region(None)
            resume(reg[2])
        if self._on_root is not None:
            listeners = _root_listeners()
            for i in range(len(listeners) - 1, -1, -1):
                if listeners[i][1] is self._on_root:
                    del listeners[i]
                    break
        with _lock:
            _users -= 1
            if self._holder is not None and not dynamo_ran():
                _holders.discard(self._holder)   # NOTE [Hooks held between steps]
            _remove_unheld()


# NOTE [Hooks held between steps]
# Dynamo guards compiled code on the global hook dictionaries' keys, so once it
# has run here an Offloader holds the hooks to its ``close()`` (once it died: to
# the next context's end): removed per step, they recompiled every step. Before,
# each step removes them: held, they slow every module call of the process.
def release(holder) -> None:
    """``holder`` no longer keeps the hooks installed (``Offloader.close``)."""
    with _lock:
        _holders.discard(holder)
        _remove_unheld()


def _remove_unheld() -> None:
    if _users == 0 and not _holders:
        for h in _handles:
            h.remove()
        _handles.clear()


def module_name(module: torch.nn.Module) -> Optional[str]:
    """The cached qualified name of ``module`` if tiermem has seen it run."""
    return _names.get(module)


def param_name(t: torch.Tensor) -> str:
    """Qualified name of the parameter ``t`` is (or is a view or alias of),
    looked up in the modules running on this thread, innermost first
    (``TinyGPT.blocks.1.ln1.weight``); a description if none holds it."""
    ptr = t.untyped_storage().data_ptr()
    for module, name in reversed(getattr(_tls, "stack", None) or ()):
        for pname, p in module._parameters.items():
            if p is not None and p.untyped_storage().data_ptr() == ptr:
                return f"{name}.{pname}"
    return "(a leaf tensor that requires grad, not a parameter of a running module)"

"""The running module, per thread, for :attr:`TensorInfo.module`.

Why not ``torch.utils.module_tracker.ModuleTracker``: its state is one set
shared by all threads, and it installs backward hooks on every module's inputs
(autograd nodes we do not need). tiermem needs only the forward stack, per
thread, and only while a context is active.

Global forward pre/post hooks are installed while at least one context is
active anywhere (reference counted); each thread keeps its own stack of
qualified names. A module's qualified name is its root's class name followed by
its path in ``root.named_modules()`` (``TinyGPT.blocks.1.ln1``), computed once
per root and cached weakly.
"""

from __future__ import annotations

import threading
import weakref
from typing import Optional

import torch
from torch.nn.modules.module import (
    register_module_forward_hook,
    register_module_forward_pre_hook,
)

_lock = threading.Lock()
_users = 0
_handles: list = []
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


def _compiling() -> bool:
    """True while Dynamo traces (``torch.compiler.is_compiling``; a constant
    to Dynamo, so the hooks below trace to nothing)."""
    return False


try:
    _compiling = torch.compiler.is_compiling   # noqa: F811
except AttributeError:   # an older torch
    pass


def _pre_hook(module: torch.nn.Module, args) -> None:
    # NOTE [Tracker under torch.compile]
    # These are global forward hooks: Dynamo traces them inside every compiled
    # module call, unlike the saved-tensor hooks (hidden from it, NOTE [Hooks
    # under torch.compile] in hooks.py). Traced, their weak dictionary of
    # names and thread-local stack become guards and mutations of the graph,
    # which broke recompiles (AssertionError "already tracked for mutation";
    # intermittently "dictionary changed size during iteration"). So they do
    # nothing while Dynamo traces: tensors saved by a compiled region are
    # packed after it, by its eager wrapper, and are named by the modules
    # running outside it.
    if _compiling():
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
    scopes = _tls.__dict__.get("scopes")
    if scopes:   # NOTE [Scoped tracking]
        for s in scopes:
            s.update(name)


def _post_hook(module: torch.nn.Module, args, output) -> None:
    if _compiling():   # NOTE [Tracker under torch.compile]
        return
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


def current_module() -> str:
    """Qualified name of the innermost running module of this thread, ``""`` if none."""
    stack = getattr(_tls, "stack", None)
    return stack[-1][1] if stack else ""


# NOTE [Scoped tracking]
# Producer tracking (a dispatch mode: a Python call per op, most of it the
# price of any mode) is needed only where a recipe's ops run. When that set is
# known, a :class:`TrackingScope` keeps the mode entered only while the
# innermost running module (``current_module()``, what ``Record.module``
# records) is named in ``names``: at each module's pre- and post-hook
# (called also when it raises) it enters or leaves the mode. ``""`` (or, for
# a context entered inside a module, that module's name) stands for the ops
# run outside every module of the context, such as a loss computed after the
# model. A wrapped block whose policy recomputes keeps the scopes that follow
# blocks entered for its whole run, nested modules included
# (:func:`track_block`). Who knows the set: a plan (the modules that ran the
# recipe ops of the tensors it recomputes, recorded by its profile:
# ``Record.module``, ``RecomputeHandle.modules``, ``Plan.tracking_scope``),
# and a wrapped block (its own run). A fixed policy with recompute, a
# callable policy, a block with MUST_RECOMPUTE, a profiled step, the safe
# order and every step of an auto Offloader with ``hints`` (its callable
# reads ``TensorInfo.op`` off the plan) track the whole forward.
# The scope is fixed when the step starts: a step that switches to another
# cached plan midway (NOTE [Following a plan] in planner/runtime.py) keeps
# the first plan's scope. Inside the scope, a step following a plan records
# only the ops its recipes use (``ops``: NOTE [Recording only what recipes
# use] in producers.py); the mode is still called for every op there.
# Exactness does not rest on the scope: an op that ran outside it has no
# record, so a recipe that reaches its output stores that tensor as an input
# (NOTE [What a recipe holds], case 4: the tensor itself, as it was at the
# op) or, if it is gone, declines (the next tier). What the scope can change
# is only which inputs a recipe stores (bytes: the closed loop measures them)
# and what the mode sees of the forward's writes: writes outside the scope to
# a dropped tensor (through an alias, the tensor itself freed) are not seen
# (its recompute returns its values at save, where autograd would raise), and
# a parameter that a recipe holds as it is, written outside the scope, is
# caught at recompute by the parameter check (NOTE [Parameters changed before
# backward] in paramcheck.py) rather than copied before the write.


_NOTHING: frozenset = frozenset()


class TrackingScope:
    """Enters ``mode`` (a dispatch mode) on this thread only while the innermost
    running module is named in ``names``, or (``blocks``) while a wrapped
    block whose policy recomputes runs. See NOTE [Scoped tracking].
    ``ops``: ``None``, or per module of ``names`` the op names the mode is to
    record there (set as ``mode.wanted`` at each module boundary; every
    recomputable op inside a block): NOTE [Recording only what recipes use]
    in producers.py. Registered by :class:`ModuleStack`."""

    __slots__ = ("mode", "names", "blocks", "active", "entries", "in_blocks", "ops")

    def __init__(self, mode, names=frozenset(), blocks: bool = False,
                 ops: Optional[dict] = None) -> None:
        self.mode = mode
        self.names = frozenset(names)
        self.blocks = blocks
        self.ops = ops
        self.active = False
        #: Times the mode was entered (tests, benchmarks).
        self.entries = 0
        #: Wrapped blocks that recompute running now (nested ones count each).
        self.in_blocks = 0

    def update(self, innermost: str) -> None:
        """The innermost running module is now ``innermost`` (``""``: none)."""
        want = self.in_blocks > 0 or innermost in self.names
        ops = self.ops
        if want and ops is not None:
            self.mode.wanted = None if self.in_blocks > 0 else ops.get(innermost, _NOTHING)
        if want is self.active:
            return
        if want:
            self.mode.__enter__()
            self.active = True
            self.entries += 1
        else:
            self.leave()

    def leave(self) -> None:
        """Leave the mode if it is active and the innermost dispatch mode (one
        entered inside the scope and not left there stays above it: ours is
        then left at the next module boundary, or at the context's exit)."""
        if not self.active:
            return
        n = torch._C._len_torch_dispatch_stack()
        if n and torch._C._get_dispatch_stack_at(n - 1) is not self.mode:
            return
        self.active = False
        self.mode.__exit__(None, None, None)


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
    (left, if active, when it exits).
    """

    def __init__(self, on_root=None, scope: Optional[TrackingScope] = None) -> None:
        self._on_root = on_root
        self._scope = scope
        self._depth = 0

    def __enter__(self) -> "ModuleStack":
        global _users
        with _lock:
            if _users == 0:
                _handles.append(register_module_forward_pre_hook(_pre_hook))
                _handles.append(register_module_forward_hook(_post_hook, always_call=True))
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
            if self._scope.active:   # still active (the ops after the model, a module unfinished)
                self._scope.active = False
                self._scope.mode.__exit__(None, None, None)
        del _stack()[self._depth:]
        if self._on_root is not None:
            listeners = _root_listeners()
            for i in range(len(listeners) - 1, -1, -1):
                if listeners[i][1] is self._on_root:
                    del listeners[i]
                    break
        with _lock:
            _users -= 1
            if _users == 0:
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

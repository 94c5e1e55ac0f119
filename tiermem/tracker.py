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
            if s.depth is None and name in s.names:
                s.enter(len(stack) - 1)


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
        for s in scopes:
            if s.depth is not None and s.depth >= i:
                s.leave()


def current_module() -> str:
    """Qualified name of the innermost running module of this thread, ``""`` if none."""
    stack = getattr(_tls, "stack", None)
    return stack[-1][1] if stack else ""


# NOTE [Scoped tracking]
# Producer tracking (a dispatch mode: a Python call per op, most of it the
# price of any mode) is needed only where a recipe's ops run. When that set of
# modules is known, the mode is entered only while they run: a
# :class:`TrackingScope` enters it at the pre-hook of the outermost module
# whose qualified name is in ``names`` (modules nested in it run inside) and
# leaves it at that module's post-hook (called also when it raises); a wrapped
# block whose policy recomputes enters the scopes that follow blocks for its
# own run (:func:`track_block`). Who knows the set: a plan (the modules that
# ran the recipe ops of the tensors it recomputes, recorded by its profile:
# ``Record.module``, ``RecomputeHandle.modules``), and a wrapped block (its own
# run). A fixed policy with recompute, a callable policy, a profiled step and
# the safe order track the whole forward (any module may recompute).
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


class TrackingScope:
    """Enters ``mode`` (a dispatch mode) only while a module named in ``names``
    runs on this thread, or (``blocks``) a wrapped block whose policy
    recomputes. See NOTE [Scoped tracking]. Registered by :class:`ModuleStack`."""

    __slots__ = ("mode", "names", "blocks", "depth", "entries")

    def __init__(self, mode, names=frozenset(), blocks: bool = False) -> None:
        self.mode = mode
        self.names = frozenset(names)
        self.blocks = blocks
        #: Stack depth of the module that entered the mode; ``None``: not active.
        self.depth: Optional[int] = None
        #: Times the mode was entered (tests, benchmarks).
        self.entries = 0

    def enter(self, depth: int) -> None:
        self.mode.__enter__()
        self.depth = depth
        self.entries += 1

    def leave(self) -> None:
        """Leave the mode if it is active and the innermost mode (a mode entered
        inside the scope and not left there stays above it: then it is left
        later, at the next module end or at the context's exit)."""
        if self.depth is None:
            return
        if torch._C._len_torch_dispatch_stack() and \
                torch._C._get_dispatch_stack_at(torch._C._len_torch_dispatch_stack() - 1) \
                is not self.mode:
            return
        self.depth = None
        self.mode.__exit__(None, None, None)


def track_block():
    """A wrapped block whose policy recomputes starts: enter the scopes of this
    thread that follow blocks and are not active. Returns what to pass to
    :func:`untrack_block` when the block ends."""
    scopes = _tls.__dict__.get("scopes")
    if not scopes:
        return ()
    entered = []
    for s in scopes:
        if s.blocks and s.depth is None:
            s.enter(max(len(_stack()) - 1, 0))
            entered.append(s)
    return entered


def untrack_block(entered) -> None:
    for s in entered:
        s.leave()


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
        if self._scope is not None:
            scopes = _tls.__dict__.get("scopes")
            if scopes is None:
                scopes = _tls.scopes = []
            scopes.append(self._scope)
        return self

    def __exit__(self, *exc) -> None:
        global _users
        if self._scope is not None:
            scopes = _tls.__dict__.get("scopes") or []
            for i in range(len(scopes) - 1, -1, -1):
                if scopes[i] is self._scope:
                    del scopes[i]
                    break
            if self._scope.depth is not None:   # still active (a module left unfinished)
                self._scope.depth = None
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

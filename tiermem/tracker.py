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
    stack.append((module, _name_of(module, stack)))


def _post_hook(module: torch.nn.Module, args, output) -> None:
    if _compiling():   # NOTE [Tracker under torch.compile]
        return
    stack = _stack()
    # Pop down to this module (robust against a module that raised inside).
    for i in range(len(stack) - 1, -1, -1):
        if stack[i][0] is module:
            del stack[i:]
            return


def current_module() -> str:
    """Qualified name of the innermost running module of this thread, ``""`` if none."""
    stack = getattr(_tls, "stack", None)
    return stack[-1][1] if stack else ""


class ModuleStack:
    """Handle of one user (a context) of the tracker on this thread.

    ``on_root(module)`` is called when a module starts at the depth the stack had
    when the context was entered, i.e. for each outermost module run inside the
    context (used to learn the parameters and buffers of the model).
    """

    def __init__(self, on_root=None) -> None:
        self._on_root = on_root
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
        return self

    def __exit__(self, *exc) -> None:
        global _users
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

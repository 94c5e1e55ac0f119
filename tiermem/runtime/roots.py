"""The parameters and buffers of the root modules an Offloader's steps run,
walked once and kept between steps (:class:`RootWalks`)."""

# NOTE [Roots walked once]
# A step learns the storages of the parameters and buffers of each root it
# runs (NOTE [Sharded parameters] in runtime/hooks.py). Walking the module tree
# is Python per module, on the host, before the first kernel; so an Offloader
# keeps each root's walk and reuses it while:
# 1. nothing was registered in the process since (torch's global module,
#    parameter and buffer registration hooks count);
# 2. the root is not sharded (FSDP2 swaps ``_parameters`` unregistered);
# 3. the root's class is the same (``fully_shard`` changes it);
# 4. each kept tensor is still in its dict (``.to()`` replaces buffers there).
# Storages are read from the kept tensors each step (``p.data = new``). An
# entry added to those dicts without registration waits for the next walk:
# exactness never rests on the storages (a missed alias is placed as an
# activation, whose handle every tier checks for in-place writes).

from __future__ import annotations

import sys
import threading
import weakref
from typing import Optional

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

__all__ = ["RootWalks", "registrations"]

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_strided = torch.strided

_count = [0]            # registrations seen since the hooks were installed
_installed: list = []   # the hooks' handles, once installed
_install_lock = threading.Lock()


def _note_registration(*_args) -> None:
    _count[0] += 1


def registrations() -> int:
    """Modules, parameters and buffers registered in the process since
    tiermem started counting (the first :class:`RootWalks`): rule 1."""
    return _count[0]


def _install() -> None:
    with _install_lock:
        if _installed:
            return
        mod = torch.nn.modules.module
        for register in ("register_module_module_registration_hook",
                         "register_module_parameter_registration_hook",
                         "register_module_buffer_registration_hook"):
            hook = getattr(mod, register, None)
            if hook is None:   # a torch without them: every step walks
                _count[0] = -1
                return
            _installed.append(hook(_note_registration))


class _Walk:
    """What one walk of a root found (rule 3: ``cls``, the root's class)."""

    __slots__ = ("root", "cls", "dense", "others", "entries", "sharded", "seen")

    def __init__(self, root: torch.nn.Module) -> None:
        self.root = weakref.ref(root)
        self.cls = type(root)
        self.dense: list = []      # plain parameters and buffers (strided)
        self.others: list = []     # other tensor types (a DTensor: its inner storages)
        self.entries: list = []    # (the module's dict, name, tensor) of each: rule 4
        self.sharded = False
        self.seen = registrations()

    def still_valid(self, root: torch.nn.Module) -> bool:
        """Rules 1 to 4 of NOTE [Roots walked once]."""
        if (self.sharded or self.seen < 0 or self.seen != registrations()
                or self.root() is not root or self.cls is not type(root)):
            return False
        for tensors, name, t in self.entries:
            if tensors.get(name) is not t:
                return False
        return True


def _walk(root: torch.nn.Module) -> _Walk:
    """One walk over the modules of ``root`` (each once): their own parameters
    and buffers, and whether one module is managed by FSDP2."""
    walk = _Walk(root)
    fsdp = getattr(sys.modules.get("torch.distributed.fsdp"), "FSDPModule", None)
    todo, seen = [root], set()
    while todo:
        m = todo.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        if fsdp is not None and isinstance(m, fsdp):
            walk.sharded = True
        for tensors in (m._parameters, m._buffers):
            for name, p in tensors.items():
                if p is None or p.layout != _strided:   # sparse ones have no storage
                    continue
                walk.entries.append((tensors, name, p))
                if type(p) is _Tensor or type(p) is _Parameter:
                    walk.dense.append(p)
                    continue
                walk.sharded = walk.sharded or is_traceable_wrapper_subclass(p)
                walk.others.append(p)
        todo.extend(c for c in m._modules.values() if c is not None)
    return walk


class RootWalks:
    """The walks of one Offloader's roots, by the root's ``id`` (NOTE [Roots
    walked once]). Not shared between threads: an Offloader runs one step at
    a time."""

    def __init__(self) -> None:
        _install()
        self._walks: dict = {}

    def walk(self, root: torch.nn.Module) -> _Walk:
        """The walk of ``root``: kept if still valid, else walked again."""
        w: Optional[_Walk] = self._walks.get(id(root))
        if w is None or not w.still_valid(root):
            w = self._walks[id(root)] = _walk(root)
            if len(self._walks) > 64:   # roots that died: drop them
                self._walks = {k: v for k, v in self._walks.items() if v.root() is not None}
        return w

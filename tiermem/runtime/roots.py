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
# A walk holds weak references only; storages are read from its tensors each
# step (``p.data = new``). An entry added to those dicts unregistered waits:
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

_count = [0]            # registrations seen while the hooks were installed
_installed: list = []   # the hooks' handles while installed
_users = [0]            # RootWalks holding the hooks
_install_lock = threading.Lock()


def _note_registration(*_args) -> None:
    _count[0] += 1


def registrations() -> int:
    """Modules, parameters and buffers registered in the process while the
    hooks were installed (a :class:`RootWalks` held them): rule 1."""
    return _count[0]


# NOTE [Registration hooks held while used]
# torch's global registration hooks are process-wide: they are installed while
# a RootWalks holds them (each Offloader's, until it is closed or collected)
# and removed when the last lets go. The count only grows, and no walk outlives
# its RootWalks, so a walk never spans a time the hooks were off. A collected
# RootWalks lets go from its finalizer, which the garbage collector may run
# inside a section holding the lock (an allocation there): a release never
# waits for the lock, and when it cannot take it at once it waits in
# ``_pending`` for the next acquire or release (else that thread deadlocks).
_pending: list = []   # flags of RootWalks collected while the lock was held


def _acquire() -> None:
    with _install_lock:
        _drain()
        _users[0] += 1
        if _installed:
            return
        mod = torch.nn.modules.module
        registers = [getattr(mod, name, None) for name in (
            "register_module_module_registration_hook",
            "register_module_parameter_registration_hook",
            "register_module_buffer_registration_hook")]
        if None in registers:   # a torch without them: nothing counted, every step walks
            _count[0] = -1
            _installed.append(None)
            return
        _installed.extend(register(_note_registration) for register in registers)


def _drain() -> None:
    """The releases that waited in ``_pending``; with the lock held."""
    while _pending:
        _let_go(_pending.pop())


def _let_go(held: list) -> None:
    """Let go of the hooks if ``held`` (a RootWalks' flag) says it holds them;
    with the lock held."""
    if not held[0]:
        return
    held[0] = False
    _users[0] -= 1
    if _users[0] == 0 and _installed and _installed[0] is not None:
        handles = list(_installed)
        _installed.clear()
        for handle in handles:
            handle.remove()


def _release(held: list) -> None:
    """A RootWalks lets go of the hooks (closed, or collected: the finalizer
    runs this too). Never waits for the lock: NOTE [Registration hooks held
    while used]."""
    if not _install_lock.acquire(blocking=False):
        _pending.append(held)
        return
    try:
        _drain()
        _let_go(held)
    finally:
        _install_lock.release()


def _storage_ptrs(t: torch.Tensor):
    """Data pointers of the memory of ``t``: its storage's, or for a wrapper
    tensor subclass (a DTensor: its local shard) those of its inner tensors;
    none for a storage that is freed (size 0) or that Python cannot see."""
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        for name in names:
            inner = getattr(t, name)
            if isinstance(inner, torch.Tensor):
                yield from _storage_ptrs(inner)
        return
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):   # a subclass without real storage
        return
    if ptr:
        yield ptr


class _Walk:
    """What one walk of a root found, by weak reference only: per tensor
    ``(module, is a buffer, name, tensor, dense)`` (``dense``: a plain
    tensor or parameter); ``cls``: the root's class (rule 3)."""

    __slots__ = ("root", "cls", "entries", "sharded", "seen")

    def __init__(self, root: torch.nn.Module) -> None:
        self.root = weakref.ref(root)
        self.cls = type(root)
        self.entries: list = []
        self.sharded = False
        self.seen = registrations()

    def valid_for(self, root: torch.nn.Module) -> bool:
        """Rules 1 to 3 of NOTE [Roots walked once] (rule 4: :meth:`collect`)."""
        return not (self.sharded or self.seen < 0 or self.seen != registrations()
                    or self.root() is not root or self.cls is not type(root))

    def collect(self, storages: set) -> bool:
        """Add the storages of the tensors found to ``storages``; ``False``
        (and maybe some added) if one is gone or no longer in its module's
        dict (rule 4): walk again."""
        add = storages.add
        for module_ref, buffer, name, tensor_ref, dense in self.entries:
            m = module_ref()
            t = tensor_ref()
            if m is None or t is None or (m._buffers if buffer else m._parameters).get(name) is not t:
                return False
            if dense:
                ptr = t.untyped_storage().data_ptr()
                if ptr:   # not freed (size 0)
                    add(ptr)
            else:
                storages.update(_storage_ptrs(t))
        return True


def _walk(root: torch.nn.Module) -> _Walk:
    """One walk over the modules of ``root`` (each once): their own parameters
    and buffers, and whether one module is managed by FSDP2."""
    walk = _Walk(root)
    fsdp = getattr(sys.modules.get("torch.distributed.fsdp"), "FSDPModule", None)
    entries = walk.entries
    todo, seen = [root], set()
    while todo:
        m = todo.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        if fsdp is not None and isinstance(m, fsdp):
            walk.sharded = True
        module_ref = weakref.ref(m)
        for buffer, tensors in ((False, m._parameters), (True, m._buffers)):
            for name, p in tensors.items():
                if p is None or p.layout != _strided:   # sparse ones have no storage
                    continue
                dense = type(p) is _Tensor or type(p) is _Parameter
                if not dense:
                    walk.sharded = walk.sharded or is_traceable_wrapper_subclass(p)
                entries.append((module_ref, buffer, name, weakref.ref(p), dense))
        todo.extend(c for c in m._modules.values() if c is not None)
    return walk


class RootWalks:
    """The walks of one Offloader's roots, by the root's ``id`` (NOTE [Roots
    walked once]). Holds no module and no tensor alive. Not shared between
    threads: an Offloader runs one step at a time."""

    def __init__(self) -> None:
        self._walks: dict = {}
        #: ``[True]`` while this holds the registration hooks (NOTE
        #: [Registration hooks held while used]); shared with its finalizer.
        self._held = [False]
        self._hold()
        weakref.finalize(self, _release, self._held).atexit = False

    def _hold(self) -> None:
        if not self._held[0]:
            _acquire()
            self._held[0] = True

    def release(self) -> None:
        """Forget every walk and let go of the registration hooks (the
        Offloader is closed); a later :meth:`note` takes them again."""
        self._walks.clear()
        _release(self._held)

    def note(self, root: torch.nn.Module, storages: set) -> bool:
        """Add the storages of ``root``'s parameters and buffers to
        ``storages``, from its kept walk if still valid, else from a new one;
        returns whether the root is sharded (FSDP2, DTensor parameters)."""
        self._hold()   # a no-op unless released (NOTE [Registration hooks held while used])
        w: Optional[_Walk] = self._walks.get(id(root))
        if w is None or not w.valid_for(root) or not w.collect(storages):
            w = self._walks[id(root)] = _walk(root)
            w.collect(storages)
            if len(self._walks) > 64:   # roots that died: drop them
                self._walks = {k: v for k, v in self._walks.items() if v.root() is not None}
        return w.sharded

"""Parameters a recipe holds as they are, checked at recompute for changes
made between the forward and the backward.
"""

# NOTE [Parameters changed before backward]
# A recompute never silently reads a parameter other than the forward's. A recipe
# holds parameters (and leaves that require grad) as an alias (``p.detach()``:
# same storage, same version counter), not a copy, and what the program may do
# between forward and backward is:
# 1. ``p.data = new``: the alias keeps the old storage, so the values are the forward's.
# 2. ``with torch.no_grad(): p.add_(...)``: the version moves; the recompute raises
#    a TierMemError naming the parameter (always on).
# 3. ``p.data.add_(...)``: only the values show it. With ``check_params`` its words
#    (a copy up to ``SNAPSHOT_MAX_BYTES``, else their 64-bit sum and xor) taken at
#    the first pack of each step are compared at the first recompute; a difference
#    raises. On CUDA the comparison's flag is read by one callback after the
#    backward's last gradient (the error says the gradients are wrong). A write
#    that only permutes the words of a larger tensor is not seen.
# A write during the forward gives the recipe a copy (producer tracking).

from __future__ import annotations

import threading
from typing import Optional

import torch

from ..errors import TierMemError
from .modules import param_name

__all__ = ["ParamChecks", "ParamWatch", "fingerprint", "SNAPSHOT_MAX_BYTES"]

_current_task = torch._C._current_graph_task_id   # -1 outside autograd's engine
_no_dispatch_modes = torch._C._DisableTorchDispatch

#: Compare on the device and read the flags at the end of backward also for
#: CPU tensors (what CUDA tensors do); for tests (tiermem.testing).
defer_on_cpu = False


#: A tensor of at most this many bytes is checked against a copy of its words
#: (one op at pack, where a fingerprint takes three, and every change is seen);
#: a larger one by its fingerprint (two int64 values, whatever its size).
SNAPSHOT_MAX_BYTES = 64 << 10


def _words(t: torch.Tensor) -> torch.Tensor:
    """``t``'s memory, in order, as 32-bit words (16- or 8-bit when the byte
    count is odd): a view where ``t`` is dense, else a copy. Run with the
    Python dispatch modes off (:func:`fingerprint`)."""
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    nbytes = t.numel() * t.element_size()
    word = torch.int32 if nbytes % 4 == 0 else torch.int16 if nbytes % 2 == 0 else torch.uint8
    if t.dim() == 0:
        t = t.reshape(1)
    return t.view(word) if t.element_size() == word.itemsize else (
        t.reshape(-1).view(torch.uint8).view(word))


def fingerprint(t: torch.Tensor, copy: bool = True) -> torch.Tensor:
    """What :class:`ParamWatch` compares of ``t``, on ``t``'s device: for a
    tensor of at most :data:`SNAPSHOT_MAX_BYTES`, its words (a copy; with
    ``copy=False`` possibly a view, for a comparison made at once), else two
    int64 values, the sum and the xor of the words in order. Asynchronous on
    CUDA (nothing is read back). ``t`` is a plain dense tensor (what a recipe
    holds): its ops skip the Python dispatch modes, so that producer tracking
    neither records nor slows them."""
    if t.requires_grad:   # a recipe's alias never does: no op below is recorded by autograd
        t = t.detach()
    with _no_dispatch_modes():
        words = _words(t)
        if t.numel() * t.element_size() <= SNAPSHOT_MAX_BYTES:
            return words.clone() if copy else words
        return torch.stack((words.sum(dtype=torch.int64),
                            torch.hash_tensor(words).view(torch.int64)))


class ParamWatch:
    """One tensor held as it is by recipes of one step: what it was at pack.

    ``held`` is the recipe's alias of it; ``name`` its qualified name (or a
    description); ``fp`` its fingerprint at pack (a tuple of ints for CPU
    tensors, compared at once; a device tensor otherwise), or ``None``
    (``check_params`` off); ``stale`` set once the forward wrote to it (the recipes then hold
    copies, and a later recipe gets a new watch)."""

    __slots__ = ("held", "name", "version", "fp", "checked_task", "stale")

    def __init__(self, held: torch.Tensor, name: str, fp: Optional[torch.Tensor]) -> None:
        self.held = held
        self.name = name
        self.version = held._version
        self.fp = fp
        self.checked_task: Optional[int] = None
        self.stale = False

    def _error(self, what: str, tail: str = "") -> TierMemError:
        return TierMemError(
            f"tiermem: parameter {self.name} (shape {list(self.held.shape)}, "
            f"{self.held.dtype}) {what} between the forward and the backward; a "
            "tensor saved by the recompute tier is regenerated from it in backward, "
            "and would no longer be what the forward computed (plain autograd uses "
            "the forward's activation). Change parameters after backward (as an "
            "optimizer does), or use a policy other than recompute for the module "
            f"that uses it.{tail}")

    def changed_error(self, deferred: bool) -> TierMemError:
        tail = " Set check_params=False (TIERMEM_CHECK_PARAMS=0) to skip this check."
        if deferred:
            tail = (" The gradients of this backward pass were computed with the new "
                    "values and are wrong." + tail)
        return self._error("was changed in place (through .data, which moves no "
                           "version counter)", tail)


class ParamChecks:
    """The :class:`ParamWatch` objects of one step (NOTE [Parameters changed
    before backward]). ``fingerprints``: the ``check_params`` setting."""

    def __init__(self, fingerprints: bool) -> None:
        self.fingerprints = fingerprints
        self._watches: dict = {}   # storage key -> ParamWatch, while packing
        self._lock = threading.Lock()
        self._deferred: list = []  # (watch, device flag) read at the end of backward
        self._queued_task: Optional[int] = None

    # -- forward ----------------------------------------------------------------
    def watch(self, held: torch.Tensor, key: tuple) -> ParamWatch:
        """The watch of ``held`` (a recipe's alias of a parameter; ``key``: its
        storage key), made at the first recipe of this step that holds it."""
        w = self._watches.get(key)
        if w is None or w.stale:
            fp = fingerprint(held) if self.fingerprints else None
            if (fp is not None and fp.device.type == "cpu" and not defer_on_cpu
                    and held.numel() * held.element_size() > SNAPSHOT_MAX_BYTES):
                fp = tuple(fp.tolist())   # compared at once: no tensor held
            w = self._watches[key] = ParamWatch(held, param_name(held), fp)
        return w

    def end_forward(self) -> None:
        self._watches.clear()

    # -- backward ---------------------------------------------------------------
    def check(self, w: ParamWatch) -> None:
        """Raise if the tensor ``w`` watches was changed since pack; called
        before each recompute that reads it (the fingerprint: once per
        backward pass)."""
        if w.held._version != w.version:
            raise w._error(f"was modified in place (version {w.version} -> "
                           f"{w.held._version})")
        if w.fp is None:
            return
        task = _current_task()
        if task != -1 and w.checked_task == task:
            return
        w.checked_task = task
        now = fingerprint(w.held, copy=False)
        if type(w.fp) is tuple or task == -1 or (now.device.type == "cpu" and not defer_on_cpu):
            if type(w.fp) is tuple:
                same = tuple(now.tolist()) == w.fp
            else:
                same = now.shape == w.fp.shape and bool(torch.equal(now, w.fp))
            if not same:
                raise w.changed_error(deferred=False)
            return
        flag = torch.ne(now, w.fp).any()
        with self._lock:
            self._deferred.append((w, flag))
            queue = self._queued_task != task
            self._queued_task = task
        if queue:
            torch.autograd.Variable._execution_engine.queue_callback(self._read_flags)

    def _read_flags(self) -> None:
        with self._lock:
            pending, self._deferred = self._deferred, []
            self._queued_task = None
        by_device: dict = {}
        for w, flag in pending:
            by_device.setdefault(flag.device, []).append((w, flag))
        for group in by_device.values():
            # The one host sync of each device, at the end of backward.
            flags = torch.stack([flag for _, flag in group]).cpu()
            for (w, _), changed in zip(group, flags.tolist()):
                if changed:
                    raise w.changed_error(deferred=True)

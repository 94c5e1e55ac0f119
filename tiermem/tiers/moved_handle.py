"""The handle of a tensor a moving tier (cpu, nvme) moved away, and what makes
its release run exactly once when autograd drops it, a KeyboardInterrupt in the
release included (NOTE [Interrupted releases]): the room goes back to the
store through its ``_unreserve`` or ``_free`` step (moving.py)."""

from __future__ import annotations

import collections
import gc

__all__ = ["MovedHandle"]


# NOTE [Interrupted releases]
# A handle's room (host buffer, disk extent) is given back exactly once, even when
# a KeyboardInterrupt lands in its release (Python then prints "Exception ignored"
# and drops it; it mostly lands at a finalizer's entry, after C work freed the handle):
# 1. No Python code runs before a dying handle is kept: ``MovedHandle.__del__`` is
#    a property whose C getter, ``_DYING.__getitem__``, stores the handle in
#    ``_DYING`` under a fresh ``_Finalizer`` (made in C), which is then called.
# 2. ``_release_dying`` releases that handle and every other whose finalizer has
#    run (``gc.is_finalized``), then drops them: an interrupted release is run
#    again at the next handle's death, not lost.
# 3. A release may so run twice or on two threads: each step of
#    ``MovedHandle._release`` is idempotent or claimed first (in bytecodes where no
#    signal handler runs), so no room is handed to two tensors; an interrupt right
#    after a claim loses that room instead. A launch takes the reservation first.
# 4. Reading ``__del__`` of a live handle keeps it (and its room) for good.

class _Finalizer:
    """What a dying handle's ``__del__`` returns, then called: NOTE
    [Interrupted releases], rule 1. One per handle; made in C."""

    __slots__ = ()

    def __call__(self) -> None:
        self.release_dying(self)


#: Dying handles whose release is not over: NOTE [Interrupted releases].
_DYING: collections.defaultdict = collections.defaultdict(_Finalizer)


def _release_dying(token: _Finalizer, _dying=_DYING, _finalized=gc.is_finalized) -> None:
    """Release the handle stored under ``token`` and those kept after an
    interrupted release (NOTE [Interrupted releases], rule 2). A release that
    fails with an ``Exception`` (not an interruption) is not tried again.
    The defaults keep what it needs through interpreter shutdown."""
    for h, t in list(_dying.items()):
        if t is token or _finalized(h):
            try:
                if getattr(h, "store", None) is not None:   # unset: dead inside put()
                    h._release()
            except Exception:
                _dying.pop(h, None)
                raise
            _dying.pop(h, None)


_Finalizer.release_dying = staticmethod(_release_dying)   # kept through shutdown


class MovedHandle:
    """A saved tensor moved away by a :class:`~.moving.MovingStore`. Owned by autograd;
    when autograd drops it, the store gets its slot back (NOTE [Interrupted
    releases]). ``released``: the store's ``_free`` was called (rule 3)."""

    __slots__ = ("store", "step", "entry", "layout", "nbytes", "slot", "version", "module",
                 "src", "host", "lease", "last_job", "restore", "cached", "tainted", "failed",
                 "tail", "released", "__weakref__")

    def __new__(cls) -> "MovedHandle":
        h = super().__new__(cls)
        h.released = False
        return h

    def _release(self) -> None:
        """Give back to the store what this dying handle holds. It may run again
        after an interruption, or on two threads: every step is idempotent or
        claimed first (NOTE [Interrupted releases], rule 3)."""
        if self.released:
            return
        self.tail = None
        if self.last_job is None:     # never launched (or its launch failed)
            self.src = None
            reservation, self.slot = self.slot, None   # claimed
            if reservation is not None:
                self.store._unreserve(reservation, self.layout)
            return
        if self.src is not None:      # died before its move out landed (last_job is that move)
            self.last_job.abandon(self.src)
            self.src = None
        self.host = None
        if self.lease is not None:    # the pool may reuse it once the move is over
            self.lease.release()      # idempotent
            self.lease = None
        self.cached = None
        if self.restore is not None:  # prefetched, never consumed
            dev, job = self.restore
            job.abandon(dev)
            self.restore = None
        if not self.released:
            self.released = True      # claimed
            self.store._free(self)

    # NOTE [Interrupted releases], rule 1: a C getter, whose value is called.
    __del__ = property(_DYING.__getitem__)

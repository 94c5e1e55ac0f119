"""Producer records: how a tensor of the forward pass was made.

A :class:`Record` holds the name of the op that made one output tensor and, for
a recipe, what is needed to run it again: the op, its non-tensor arguments, a
:class:`Ref` per tensor argument (held weakly) and the generator state it drew
from. :func:`storage_key` is the identity of a tensor's values. The producer
mode (tracking/producers.py) makes the records; the recompute tier reads them.
"""

# NOTE [Records hold no tensor]
# A record must never keep a tensor alive: the point of recomputing is to free
# memory. Tensor arguments are held by weak reference, with the version they
# had when the op ran and the record of *their* producer (records form a DAG
# of small Python objects, dropped when the context exits). Records are found
# by the identity of the output's Python object (``id`` checked against a weak
# reference): PyTorch hands the pack hook the very object the op returned, and
# an ``id`` reused by a later tensor fails the weak-reference check.

# NOTE [Version of a record]
# A record describes a tensor's values when it was made (``Record.version``).
# After an in-place op (or an in-place op on a view of it) the version moves
# on and the record no longer describes the tensor: it is only used while the
# tensor's version still equals ``Record.version``; an argument only while its
# version at the op (``Ref.version``) equals the version its own record (or
# its stored copy) describes.

from __future__ import annotations

import weakref
from typing import Optional

import torch

__all__ = ["Record", "Ref", "storage_key"]

#: The tensors a record is made for and a :class:`Ref` can hold: dense tensors
#: (and parameters) of the base class.
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)
_STRIDED = torch.strided
_weakref = weakref.ref


def _plain(t: torch.Tensor) -> bool:
    """A dense tensor (or parameter) of the base class with a version counter."""
    return type(t) in _PLAIN_TYPES and t.layout is _STRIDED and not t.is_inference()


def storage_key(t: torch.Tensor, storage=None) -> tuple:
    """Identity of a tensor's *values*: two tensors with equal keys on the same
    live storage hold the same elements (the dedup key of the Offloader)."""
    if storage is None:
        storage = t.untyped_storage()
    # conj()/_neg_view() are lazy views with the very same storage geometry:
    # their bits are part of what the values are.
    return (storage.data_ptr(), t.storage_offset(), tuple(t.size()), t.stride(), t.dtype,
            t._version, t.is_conj(), t.is_neg())


class _StorageRef:
    """A weak reference to a storage: pins the storage object's identity (its
    ``cdata`` address cannot be reused while held), not its memory. What
    ``StorageWeakRef`` holds, made for half its cost (one made per tensor
    argument of each recorded op)."""

    __slots__ = ("cdata",)

    def __init__(self, storage) -> None:
        self.cdata = storage._weak_ref()

    def __del__(self, _free=torch.UntypedStorage._free_weak_ref) -> None:
        _free(self.cdata)


class Ref:
    """A tensor argument of a recorded op, held weakly (NOTE [Records hold no tensor]).

    ``key`` and ``storage`` (a weak reference to the storage; only its
    ``cdata`` is read) find the handle of the same values later even when
    this Python object is gone: the pack hook often stores a different object
    (``t.detach()``, a copy) than the one the op received.
    """

    __slots__ = ("tensor_ref", "version", "record", "nbytes", "key", "storage")

    def __init__(self, t: torch.Tensor, record: Optional["Record"]) -> None:
        self.tensor_ref = _weakref(t)
        self.version = version = t._version
        self.record = record
        self.nbytes = t.nbytes
        storage = t.untyped_storage()
        # storage_key(t, storage), inlined: one Ref per tensor argument of each recorded op.
        self.key = (storage.data_ptr(), t.storage_offset(), tuple(t.size()), t.stride(),
                    t.dtype, version, t.is_conj(), t.is_neg())
        self.storage = _StorageRef(storage)

    def alive(self) -> Optional[torch.Tensor]:
        """The argument if it is still alive and unchanged since the op ran.

        A storage resized since then (its data pointer moved or is null) counts
        as gone: FSDP2 frees its unsharded parameters with ``resize_(0)`` after
        a block's forward, leaving the tensor alive and its version unchanged
        (see NOTE [Sharded parameters] in runtime/hooks.py)."""
        t = self.tensor_ref()
        if t is None or t._version != self.version:
            return None
        if t.untyped_storage().data_ptr() != self.key[0]:
            return None
        return t


class Record:
    """How one output tensor was made. ``func is None`` when only the name is
    known (the op is not recomputable)."""

    __slots__ = ("name", "func", "args", "kwargs", "out_index", "rng", "version", "is_view",
                 "values_op", "module", "call", "returned", "position", "__weakref__")

    def __init__(self, name: str, values_op: str, func=None, args: tuple = (),
                 kwargs: Optional[dict] = None, out_index: Optional[int] = None, rng=None,
                 version: int = 0, is_view: bool = False, module: Optional[str] = None,
                 call: Optional[str] = None, position: int = -1) -> None:
        self.name = name
        self.values_op = values_op
        #: The op to run again (``None``: only the name is known), its held
        #: arguments (:class:`Ref` per tensor), which output is this one
        #: (``None``: the only one), and the generator state it drew from.
        self.func = func
        self.args: tuple = args
        self.kwargs: dict = {} if kwargs is None else kwargs
        self.out_index: Optional[int] = out_index
        self.rng = rng
        #: The output's version when it was made (NOTE [Version of a record]).
        self.version = version
        self.is_view = is_view
        #: Qualified name of the innermost module the op ran in (``""``: none),
        #: recorded only by a mode made with ``module_names=True``; else ``None``.
        self.module: Optional[str] = module
        #: Name of the outermost torch call (``F.linear``: ``"linear"``) the op
        #: ran in, recorded with ``module`` while a
        #: :class:`~tiermem.tracking.producers.CallRecorder` runs
        #: (NOTE [Tracking inside torch calls] in tracking/modules.py); ``None``: not
        #: recorded, or the op ran outside every torch call.
        self.call: Optional[str] = call
        #: The torch call ``call`` returned this tensor (set by a
        #: :class:`~tiermem.tracking.producers.CallRecorder`; NOTE [Calls recorded
        #: whole] in tracking/producers.py).
        self.returned = False
        #: The op's position among the ops the mode saw in this forward (-1:
        #: a record made otherwise): NOTE [Records learned by position] in
        #: tiers/positions.py.
        self.position = position

    def refs(self):
        """The :class:`Ref` of every tensor argument (lists flattened)."""
        return _refs(self.args, self.kwargs)


def _refs(args: tuple, kwargs: dict):
    """The :class:`Ref` of every captured tensor argument (lists flattened)."""
    for a in args + tuple(kwargs.values()):
        if type(a) is Ref:
            yield a
        elif type(a) is list:
            yield from (x for x in a if type(x) is Ref)


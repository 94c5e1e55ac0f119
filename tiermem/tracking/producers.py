"""Producer tracking: which op made each tensor of the forward pass, from what.

While an Offloader whose policy may look at ``TensorInfo.op`` (a callable) or
may recompute is active, :class:`ProducerMode` (a ``TorchDispatchMode``, the
same mechanism PyTorch's selective checkpointing uses) sees every aten op the
forward runs and records, for each output tensor, a :class:`Record`: the op's
name and, for ops on the recompute allow-list, what is needed to run it again
(the op, its non-tensor arguments, and a :class:`Ref` per tensor argument).

The allow-list (:data:`RECOMPUTABLE_OPS`) holds cheap ops that are
deterministic on CPU and CUDA: pointwise math and activations, casts, views,
layer/RMS/group norm, softmax, concatenation, embedding lookups, and the
random ops whose generator state is captured (:data:`RANDOM_OPS`). Matmuls and
attention are left out on purpose (their cost is what recomputing avoids;
checkpointing covers them). Ops with a mutable schema (in-place, ``out=``) are
never recomputable.
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
from typing import Any, Optional

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from .modules import _compiling, call_name, current_module

__all__ = ["ProducerMode", "CallRecorder", "Record", "Ref", "call_name", "storage_key",
           "untracked_pack",
           "RECOMPUTABLE_OPS", "RANDOM_OPS", "VIEW_OPS"]

_aten = torch.ops.aten

# NOTE [Ops run as without a mode]
# Tracking must not change the forward's values. PyTorch runs a dispatch mode's
# handler with the Conjugate, Negative and ZeroTensor keys excluded, and the op
# the handler calls runs under that exclusion: a kernel that makes a lazy
# conjugate (or negative) view inside and hands it to another op would consume
# it as a plain tensor (complex ``linalg.pinv`` gives wrong values under any
# mode). So the handler runs the op with those keys allowed again, as without a
# mode, and excludes them again after; its arguments are already resolved, so
# only what the kernel makes inside meets them. Only when ours is the last mode
# and no argument is a tensor subclass: otherwise the op goes on as PyTorch
# hands it over, as it would without tiermem.
_KEY = torch._C.DispatchKey
_VIEW_BIT_KEYS = tuple(getattr(_KEY, n) for n in ("Conjugate", "Negative", "ZeroTensor")
                       if hasattr(_KEY, n))
_is_excluded = torch._C._dispatch_tls_is_dispatch_key_excluded
_set_excluded = torch._C._dispatch_tls_set_dispatch_key_excluded
_modes_below = torch._C._len_torch_dispatch_stack   # inside a handler: the modes under it
_dispatch_at = torch._C._get_dispatch_stack_at


def _run_as_without_mode(func, types, args, kwargs):
    """``func(*args, **kwargs)`` with NOTE [Ops run as without a mode]."""
    if types or _modes_below():   # a subclass or another mode handles it: as PyTorch does
        return func(*args, **kwargs)
    excluded = [k for k in _VIEW_BIT_KEYS if _is_excluded(k)]
    if not excluded:
        return func(*args, **kwargs)
    for k in excluded:
        _set_excluded(k, False)
    try:
        return func(*args, **kwargs)
    finally:
        for k in excluded:
            _set_excluded(k, True)


# NOTE [The pack hook runs untracked]
# Tiermem's own ops in the pack hook (the ``detach`` of each handle, a staging
# copy, a recipe input's copy) never go through the step's mode: autograd calls
# the pack hook after the op's kernel, with the mode back on the stack, but none
# of those ops is the model's (a saved tensor's record is the op's that made it,
# recorded before its pack) and they write only tiermem's own new tensors. So
# while the pack hook runs, the mode is taken off the dispatch stack when it is
# the innermost mode, and put back after: one pop and one push instead of a
# Python call per op. The same in the profiled step, so the profile's op counts
# (NOTE [Tracking priced] in planner/runtime.py) are the followed step's.
_pop_dispatch = torch._C._pop_torch_dispatch_stack
_push_dispatch = torch._C._push_on_torch_dispatch_stack


def untracked_pack(mode: "ProducerMode", pack):
    """``pack`` run with ``mode`` off the dispatch stack: NOTE [The pack hook
    runs untracked]."""
    def run(t):
        n = _modes_below()
        if not n or _dispatch_at(n - 1) is not mode:
            return pack(t)
        popped = _pop_dispatch(None)
        try:
            return pack(t)
        finally:
            _push_dispatch(popped)
    return run


def _packets(*names: str) -> frozenset:
    return frozenset(getattr(_aten, n) for n in names if hasattr(_aten, n))


#: Ops that return a view of their first argument (zero FLOPs). ``op`` in
#: :class:`~tiermem.TensorInfo` looks through them to the op that computed the values.
VIEW_OPS = _packets(
    "view", "_unsafe_view", "_reshape_alias", "reshape", "expand", "transpose", "t",
    "permute", "slice", "select", "split", "split_with_sizes", "unsqueeze", "squeeze",
    "unbind", "chunk", "narrow", "as_strided", "alias", "detach", "flatten", "unflatten",
    "view_as_real", "view_as_complex", "diagonal", "unfold")

_VIEW_NAMES = frozenset(p.__name__ for p in VIEW_OPS)

#: Ops that draw random numbers from a generator; recomputed exactly by replaying
#: the generator state captured just before they ran (no device sync).
RANDOM_OPS = _packets("native_dropout", "bernoulli", "rand_like", "randn_like",
                      "randint_like")

_RANDOM_NAMES = frozenset(p.__name__ for p in RANDOM_OPS)

#: Views that take an *absolute* storage offset or raw strides: replaying them
#: on an input restored at another offset or with other strides (a copy) would
#: read other elements, so they are named but never recomputed.
_ABSOLUTE_VIEWS = _packets("as_strided", "_reshape_alias")

#: Cheap, deterministic ops whose outputs the recompute tier may drop.
RECOMPUTABLE_OPS = (VIEW_OPS - _ABSOLUTE_VIEWS) | RANDOM_OPS | _packets(
    # activations and pointwise math
    "relu", "gelu", "silu", "sigmoid", "tanh", "hardtanh", "leaky_relu", "elu", "celu",
    "selu", "softplus", "mish", "hardswish", "hardsigmoid", "glu", "log_sigmoid_forward",
    "exp", "log", "sqrt", "rsqrt", "reciprocal", "neg", "abs", "sin", "cos", "erf", "square",
    "add", "sub", "rsub", "mul", "div", "pow", "maximum", "minimum", "clamp", "clamp_min",
    "clamp_max", "where", "masked_fill", "lt", "le", "gt", "ge", "eq", "ne",
    "logical_not", "logical_and", "logical_or",
    # casts and copies
    "_to_copy", "clone", "contiguous", "cat", "stack",
    # normalisation and softmax (deterministic row-wise reductions)
    "native_layer_norm", "_fused_rms_norm", "native_group_norm", "_softmax", "_safe_softmax",
    "_log_softmax",
    # lookups
    "embedding", "index_select")


def _alias_fits(t: torch.Tensor, base: torch.Tensor) -> bool:
    """``t`` (contiguous) holds ``base``'s elements in ``base``'s order: NOTE
    [Views made inside untracked calls]."""
    return (base.is_contiguous() and t.dtype == base.dtype and t.numel() == base.numel()
            and t.storage_offset() == base.storage_offset() and t.device == base.device
            and t.untyped_storage()._cdata == base.untyped_storage()._cdata
            and not t.is_conj() and not t.is_neg() and not base.is_conj() and not base.is_neg())


class CallRecorder(TorchFunctionMode):
    """Keeps ``producers.call`` (a :class:`ProducerMode`) set to the name of
    the torch call running now, for ``Record.call`` (a profiled step: NOTE
    [Tracking inside torch calls] in tracking/modules.py). A function mode sees only
    the outermost torch call (it is not active inside its own handler): the
    call a step's :class:`~tiermem.tracking.modules.CallGate` sees too."""

    tiermem_mode = True   # tracking/modestack.py

    def __init__(self, producers: "ProducerMode") -> None:
        super().__init__()
        self.producers = producers

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if _compiling():   # NOTE [Compiled regions run without our modes] in tracking/modestack.py
            return func(*args, **(kwargs or {}))
        p = self.producers
        outer = p.call
        name = p.call = call_name(func)
        counting = getattr(p, "op_counts", None) is not None and outer is None
        if counting:
            module, before = current_module(), p.ops_run
        try:
            out = func(*args, **(kwargs or {}))
        finally:
            p.call = outer
        if counting:   # NOTE [Calls recorded whole]: was this call one op?
            p.note_call(module, name, p.ops_run - before, out)
        return out


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
        self.tensor_ref = weakref.ref(t)
        self.version = t._version
        self.record = record
        self.nbytes = t.nbytes
        storage = t.untyped_storage()
        self.key = storage_key(t, storage)
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
                 "values_op", "module", "call", "returned", "__weakref__")

    def __init__(self, name: str, values_op: str) -> None:
        self.name = name
        self.values_op = values_op
        self.func = None
        self.args: tuple = ()
        self.kwargs: dict = {}
        self.out_index: Optional[int] = None
        self.rng = None
        self.version = 0
        self.is_view = False
        #: Qualified name of the innermost module the op ran in (``""``: none),
        #: recorded only by a mode made with ``module_names=True``; else ``None``.
        self.module: Optional[str] = None
        #: Name of the outermost torch call (``F.linear``: ``"linear"``) the op
        #: ran in, recorded with ``module`` while a :class:`CallRecorder` runs
        #: (NOTE [Tracking inside torch calls] in tracking/modules.py); ``None``: not
        #: recorded, or the op ran outside every torch call.
        self.call: Optional[str] = None
        #: The torch call ``call`` returned this tensor (set by a
        #: :class:`CallRecorder`; NOTE [Calls recorded whole]).
        self.returned = False

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


class _OpInfo:
    __slots__ = ("name", "recomputable", "random", "view", "written")

    def __init__(self, func) -> None:
        packet = func.overloadpacket
        self.name = packet.__name__
        self.view = packet in VIEW_OPS
        self.random = packet in RANDOM_OPS
        schema = func._schema
        self.recomputable = packet in RECOMPUTABLE_OPS and not schema.is_mutable
        #: (position, name) of the arguments the op writes to (in-place, out=).
        self.written = tuple((i, a.name) for i, a in enumerate(schema.arguments)
                             if a.alias_info is not None and a.alias_info.is_write)


class _Unsupported:
    """Marks a tensor argument the recompute tier cannot hold (inference
    tensors, sparse or other layouts, tensor subclasses)."""


_UNSUPPORTED = _Unsupported()


_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)
_STRIDED = torch.strided
_inference_mode = torch.is_inference_mode_enabled


def _plain(t: torch.Tensor) -> bool:
    """A dense tensor (or parameter) of the base class with a version counter."""
    return type(t) in _PLAIN_TYPES and t.layout is _STRIDED and not t.is_inference()


def _first_device(args) -> Optional[torch.device]:
    """The device of the first tensor in ``args`` (lists and tuples looked
    into), ``None`` if there is none."""
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device
        if isinstance(a, (list, tuple)):
            for x in a:
                if isinstance(x, torch.Tensor):
                    return x.device
    return None


def _drew_nothing(rng: tuple) -> bool:
    """Whether the generator of ``rng`` (generator, state before a call) is
    still in that state: NOTE [Calls recorded whole], rule 6."""
    gen, before = rng
    return gen.get_state().numpy().tobytes() == before.numpy().tobytes()


def _generator_for(device: torch.device, explicit) -> Optional[torch.Generator]:
    if explicit is not None:
        return explicit
    if device.type == "cpu":
        return torch.default_generator
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    return None


class ProducerMode(TorchDispatchMode):
    """Records the producer of every tensor made while it is active (one
    forward pass, one thread: the dispatch-mode stack is thread-local).

    ``module_names``: also record, in each recomputable record, the module the
    op ran in (``Record.module``; the planner's profile uses it to scope the
    tracking of the steps that follow its plan: NOTE [Scoped tracking] in
    tracking/modules.py). It may be entered and left several times in one forward (the
    records made so far stay valid).

    ``names``: also record the ops that are not recomputable (name only), so
    that :meth:`op_name` answers for every tensor (``TensorInfo.op``). With
    ``names=False`` (a step whose policy never reads ``TensorInfo.op``) they
    run unrecorded, and :meth:`op_name` is not to be asked (it answers only
    for recorded ops, without looking through views). ``wanted``: ``None``,
    or the op names (``aten`` packet names) to record; a
    :class:`~tiermem.tracking.modules.TrackingScope` sets it per module. See NOTE
    [Recording only what recipes use]."""

    tiermem_mode = True   # tracking/modestack.py

    def __init__(self, module_names: bool = False, names: bool = True) -> None:
        super().__init__()
        self.module_names = module_names
        self.names = names
        #: Name of the torch call running now, kept by a :class:`CallRecorder`
        #: (recorded in ``Record.call`` with ``module_names``).
        self.call: Optional[str] = None
        #: Index recorded contiguous outputs by storage, for NOTE [Views made
        #: inside untracked calls] (a step whose tracking is scoped).
        self.alias_index = False
        self._by_storage: dict = {}   # (storage cdata, offset) -> (weakref to tensor, Record)
        #: ``None``, or a dict counting the ops this mode handles per (module,
        #: torch call) (a profiled step: what tracking them would cost, NOTE
        #: [Tracking priced] in planner/runtime.py).
        self.op_counts: Optional[dict] = None
        #: With ``op_counts``: ops handled so far, the last one's ``_OpInfo``,
        #: and per (module, torch call) the op name every such call ran alone
        #: (``False``: one ran some other number of ops, or another op, or
        #: one that cannot be recorded whole): NOTE [Calls recorded whole].
        self.ops_run = 0
        self.last_op: Optional["_OpInfo"] = None
        self.single_op_calls: dict = {}
        #: Op names to record (``None``: every recomputable op).
        self.wanted: Optional[frozenset] = None
        self._records: dict = {}    # id(tensor) -> (weakref to tensor, Record)
        self._ops: dict = {}        # OpOverload -> _OpInfo
        #: storage cdata -> [weakref to a dropped tensor's handle]: see NOTE
        #: [Writes to dropped tensors].
        self._watched: dict = {}
        #: storage cdata -> [weakref to a handle whose recipe holds a tensor on
        #: it as it is]: see NOTE [Writes to recipe inputs].
        self._watched_inputs: dict = {}

    # -- lookup (pack hook) -----------------------------------------------------
    def record_of(self, t: torch.Tensor) -> Optional[Record]:
        """The record describing ``t``'s current values, or ``None``. With
        ``alias_index``, a tensor with no record of its own may get one made
        from the record of the tensor it aliases: NOTE [Views made inside
        untracked calls]."""
        hit = self._records.get(id(t))
        if hit is None or hit[0]() is not t:
            return self._alias_record(t) if self._by_storage else None
        rec = hit[1]
        return rec if rec.version == t._version else None

    # NOTE [Views made inside untracked calls]
    # A contiguous tensor that starts where a recorded contiguous tensor of the
    # same dtype and element count starts, on the same storage, holds that
    # tensor's elements in the same order, so ``reshape(base, shape)`` regenerates
    # it from the base's recipe. So a view a torch call makes itself (F.linear
    # saves ``input.view(-1, in)``) needs no tracking inside that call: a scoped
    # step indexes the contiguous outputs it records by storage and offset
    # (``alias_index``) and makes such a record for a saved tensor that has none;
    # the profile marks such recipes (``alias_of``). Exactness does not rest on
    # it: without the base's record the tensor has no recipe (the next tier).
    def _alias_record(self, t: torch.Tensor) -> Optional[Record]:
        if type(t) not in _PLAIN_TYPES or t.layout is not _STRIDED or not t.is_contiguous():
            return None
        storage = t.untyped_storage()
        hit = self._by_storage.get((storage._cdata, t.storage_offset()))
        if hit is None:
            return None
        base = hit[0]()
        rec = hit[1]
        if base is None or base._version != rec.version or not _alias_fits(t, base):
            return None
        alias = Record("reshape", rec.values_op)
        alias.func = _aten.reshape.default
        alias.args = (Ref(base, rec), list(t.shape))
        alias.version = t._version
        alias.is_view = True
        alias.module, alias.call = rec.module, rec.call
        return alias

    def alias_of(self, t: torch.Tensor, rec: Record) -> bool:
        """Whether ``rec`` (``t``'s record) is a view whose output a scoped step
        can make again from its base's record: NOTE [Views made inside
        untracked calls]."""
        if not rec.is_view or not rec.args or type(rec.args[0]) is not Ref:
            return False
        ref = rec.args[0]
        base = ref.alive()
        sub = ref.record
        return (base is not None and sub is not None and sub.func is not None
                and sub.version == ref.version and t.is_contiguous() and _alias_fits(t, base))

    def op_name(self, t: torch.Tensor) -> Optional[str]:
        """The op that computed ``t``'s values (views looked through), or ``None``."""
        hit = self._records.get(id(t))
        if hit is None or hit[0]() is not t:
            return None
        return hit[1].values_op

    def watch(self, t: torch.Tensor, handle) -> None:
        """Mark ``handle.tainted`` if an op of this forward writes to ``t``'s storage.

        # NOTE [Writes to dropped tensors]
        # A dropped (recompute) tensor is not held, so its version cannot be
        # checked at unpack once the program has let go of it. Autograd raises
        # when a saved tensor, or any view sharing its version counter, was
        # written in place after the save; the mode sees every write of the
        # forward, so it taints the handles of tensors on the written storage
        # (views of one base share both), and unpack raises as autograd would.
        """
        # The weak storage ref is kept: it pins the storage object's address,
        # so a later storage cannot be mistaken for this one.
        ref = StorageWeakRef(t.untyped_storage())
        entry = self._watched.get(ref.cdata)
        if entry is None:
            entry = self._watched[ref.cdata] = (ref, [])
        entry[1].append(weakref.ref(handle))

    def watch_input(self, t: torch.Tensor, leaf) -> None:
        """Call ``leaf.snapshot(copies)`` before an op of this forward writes to
        ``t``'s storage (``copies``: shared by the leaves of one write).

        # NOTE [Writes to recipe inputs]
        # A recipe holds parameters and leaves that require grad as they are
        # (NOTE [What a recipe holds]): they are not modified during a forward
        # pass, as a rule. Some programs do: nn.Embedding(max_norm=...) renorms
        # its weight in place at each call, a leaf may be written through a
        # .detach() alias. Autograd does not mind (it did not save them), so
        # neither may tiermem: the mode sees the write before it happens, and
        # each recipe leaf holding that tensor as it is takes a copy of its
        # values of now (one copy per tensor and write, shared by the leaves),
        # so the recipe regenerates exactly what the forward computed. Writes
        # after the forward (a ``.data`` change before backward) are not seen.
        """
        ref = StorageWeakRef(t.untyped_storage())
        entry = self._watched_inputs.get(ref.cdata)
        if entry is None:
            entry = self._watched_inputs[ref.cdata] = (ref, [])
        entry[1].append(weakref.ref(leaf))

    def _note_writes(self, info: "_OpInfo", args, kwargs) -> None:
        for i, name in info.written:
            t = args[i] if i < len(args) else kwargs.get(name)
            if not isinstance(t, torch.Tensor) or not _plain(t):
                continue
            key = self._taint(t)
            entry = self._watched_inputs.pop(key, None)
            if entry is not None:   # after the write these leaves hold copies
                copies: dict = {}
                for ref in entry[1]:
                    leaf = ref()
                    if leaf is not None:
                        leaf.snapshot(copies)

    def _taint(self, t: torch.Tensor) -> int:
        """Mark the handles of dropped tensors on ``t``'s storage written (NOTE
        [Writes to dropped tensors]); returns the storage's key."""
        key = StorageWeakRef(t.untyped_storage()).cdata
        entry = self._watched.get(key)
        if entry is not None:
            for ref in entry[1]:
                h = ref()
                if h is not None:
                    h.tainted = True
        return key

    def clear(self) -> None:
        self._records.clear()
        self._by_storage.clear()
        self._watched.clear()
        self._watched_inputs.clear()

    # -- recording ----------------------------------------------------------------
    def _ref(self, t: torch.Tensor) -> Ref:
        hit = self._records.get(id(t))
        rec = hit[1] if hit is not None and hit[0]() is t else None
        return Ref(t, rec)

    # NOTE [Recording only what recipes use]
    # Only the recompute tier needs records of recomputable ops; to it a record
    # with ``func=None`` and no record at all both mean "no recipe from here". So:
    # 1. a mode made with ``names=False`` (no one reads ``TensorInfo.op``) records
    #    no op that is not recomputable; its writes are still seen;
    # 2. in a step following a plan, ``wanted`` holds, per module, the names of the
    #    ops the plan's recipes ran there (``Plan.tracking_ops``), and other ops run
    #    unrecorded: the step finds again every record its recipes used, given the
    #    same forward.
    # Exactness does not rest on either: a record is made in full or not at all,
    # and a missing one only makes a recipe store that tensor or decline.

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        counts = self.op_counts
        info = self._ops.get(func)
        if info is None:
            info = self._ops[func] = _OpInfo(func)
        if counts is not None:
            key = (current_module(), self.call)
            counts[key] = counts.get(key, 0) + 1
            self.ops_run += 1
            self.last_op = info
        if _inference_mode():   # inference tensors: nothing to record
            return _run_as_without_mode(func, types, args, kwargs)
        if info.written and (self._watched or self._watched_inputs):
            self._note_writes(info, args, kwargs)
        recomputable = info.recomputable
        if recomputable:
            wanted = self.wanted
            if wanted is not None and info.name not in wanted:
                recomputable = False
        if not recomputable and not self.names:   # NOTE [Recording only what recipes use]
            return _run_as_without_mode(func, types, args, kwargs)
        rng = None
        if recomputable:
            # Arguments are captured before the op runs (their versions then).
            captured = self._capture_all(args, kwargs)
            if captured is None:
                recomputable = False
            else:
                rargs, rkwargs = captured
                if info.random:
                    rng = self._capture_rng(args, kwargs)
                    if rng is None:
                        recomputable = False
        out = _run_as_without_mode(func, types, args, kwargs)
        values_op = info.name
        if self.names and info.view and args and isinstance(args[0], torch.Tensor):
            base = self._records.get(id(args[0]))
            if base is not None and base[0]() is args[0]:
                values_op = base[1].values_op
        multi = isinstance(out, (tuple, list))
        outs = out if multi else (out,)
        records = self._records
        for i, o in enumerate(outs):
            if type(o) not in _PLAIN_TYPES or o.layout is not _STRIDED or o.is_inference():
                continue   # not a tensor, or one the recompute tier cannot hold
            rec = Record(info.name, values_op)
            rec.version = o._version
            if recomputable:
                rec.rng = rng
                self._recipe(rec, o, func, rargs, rkwargs, i if multi else None, info.view,
                             self.call)
            records[id(o)] = (weakref.ref(o), rec)
        return out

    def _recipe(self, rec: Record, o: torch.Tensor, func, args: tuple, kwargs: dict,
                out_index: Optional[int], view: bool, call: Optional[str]) -> None:
        """Make ``rec`` (``o``'s record) a recipe: ``func(*args, **kwargs)``
        (``[out_index]``) regenerates ``o``."""
        rec.func, rec.args, rec.kwargs = func, args, kwargs
        rec.out_index = out_index
        rec.is_view = view
        if self.module_names:
            rec.module = current_module()
            rec.call = call
        if self.alias_index and o.is_contiguous():   # NOTE [Views made inside untracked calls]
            key = (o.untyped_storage()._cdata, o.storage_offset())
            hit = self._by_storage.get(key)
            if hit is None or hit[0]() is None:
                self._by_storage[key] = (weakref.ref(o), rec)

    # NOTE [Calls recorded whole]
    # A torch call that the profile saw run exactly one recomputable aten op, always
    # the same (``note_call``; listed in ``Plan.tracking_direct``), is recorded at
    # the torch-function level (``record_call``) without entering the dispatch mode:
    # its Record's ``func`` is the torch function, replayed under no_grad and
    # without autocast. Exact because:
    # 1. the replay is the very function on inputs equal in values and layout;
    # 2. only while no autocast is active: else the call goes through the mode;
    # 3. a call that wrote to or returned an argument is not recorded;
    # 4. subclass arguments and inference mode are not recorded, as by the mode;
    # 5. a call whose op draws random numbers replays the generator state captured
    #    before it ran (``_capture_rng``); unknown generator: not recorded;
    # 6. any other call may draw too: the state is compared after it, and a changed
    #    one is replayed as in rule 5.
    # Only returned tensors get records (``Record.returned``).
    def note_call(self, module: str, call: str, n_ops: int, out: Any) -> None:
        """A profiled torch call ``call`` in ``module`` ran ``n_ops`` ops (the
        last of them ``last_op``) and returned ``out``, whose records it marks
        ``returned``: NOTE [Calls recorded whole]."""
        records = self._records
        for o in (out if isinstance(out, (tuple, list)) else (out,)):
            hit = records.get(id(o))
            if hit is not None and hit[0]() is o:
                hit[1].returned = True
        key = (module, call)
        info = self.last_op if n_ops == 1 else None
        calls = self.single_op_calls
        if info is None or not info.recomputable:
            calls[key] = False
        else:
            seen = calls.get(key)
            if seen is None:
                calls[key] = info.name
            elif seen != info.name:
                calls[key] = False

    def record_call(self, func, args, kwargs: dict, name: str):
        """``func(*args, **kwargs)`` (a torch call that ran the one op ``name``
        in the profile), its outputs recorded as made by the call itself: NOTE
        [Calls recorded whole]."""
        captured = None if _inference_mode() else self._capture_all(args, kwargs)
        rng = None
        if captured is not None:   # rules 5 and 6
            rng = self._capture_rng(args, kwargs)
            if rng is None:
                captured = None
        out = func(*args, **kwargs)
        if captured is None:
            return out
        if name not in _RANDOM_NAMES and _drew_nothing(rng):   # rule 6
            rng = None
        rargs = tuple(a.copy() if type(a) is list else a for a in captured[0])   # rule 1
        rkwargs = {k: (v.copy() if type(v) is list else v) for k, v in captured[1].items()}
        multi = isinstance(out, (tuple, list))
        outs = out if multi else (out,)
        ok = True
        for r in _refs(rargs, rkwargs):   # rule 3
            t = r.tensor_ref()
            if t is None:
                continue
            if t._version != r.version:
                self._taint(t)
                ok = False
            elif any(o is t for o in outs):
                ok = False
        if not ok:
            return out
        view = name in _VIEW_NAMES
        values_op = name
        if view and rargs and type(rargs[0]) is Ref and rargs[0].record is not None:
            values_op = rargs[0].record.values_op
        records = self._records
        for i, o in enumerate(outs):
            if type(o) not in _PLAIN_TYPES or o.layout is not _STRIDED or o.is_inference():
                continue
            rec = Record(name, values_op)
            rec.version = o._version
            rec.rng = rng
            self._recipe(rec, o, func, rargs, rkwargs, i if multi else None, view,
                         call_name(func))
            records[id(o)] = (weakref.ref(o), rec)
        return out

    def _capture_all(self, args, kwargs) -> Optional[tuple]:
        """``(args, kwargs)`` as a record holds them, or ``None`` if an
        argument cannot be held (then the op is not recomputable)."""
        capture = self._capture
        rargs = []
        for a in args:
            c = capture(a)
            if c is _UNSUPPORTED:
                return None
            rargs.append(c)
        rkwargs = {}
        for k, v in kwargs.items():
            c = capture(v)
            if c is _UNSUPPORTED:
                return None
            rkwargs[k] = c
        return tuple(rargs), rkwargs

    def _capture(self, a: Any) -> Any:
        t = type(a)
        if t is torch.Tensor or t is torch.nn.Parameter:
            return self._ref(a) if a.layout is _STRIDED and not a.is_inference() else _UNSUPPORTED
        if isinstance(a, torch.Tensor):   # a subclass
            return _UNSUPPORTED
        if isinstance(a, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in a):
            if not all(_plain(x) for x in a if isinstance(x, torch.Tensor)):
                return _UNSUPPORTED
            return [self._ref(x) if isinstance(x, torch.Tensor) else x for x in a]
        return a

    @staticmethod
    def _capture_rng(args, kwargs):
        """(generator, state) of the generator the op will draw from; ``None``
        if unknown (the op is then not recomputable). ``get_state`` copies the
        host-side state (CUDA: seed and offset), no device sync. A ``device``
        argument (``torch.rand_like(x, device="cuda")``) names the device the
        op draws on, before its tensors'."""
        device = kwargs.get("device")
        if device is not None:
            device = torch.device(device)
        else:
            device = _first_device(args)
        if device is None:
            device = _first_device(kwargs.values())
        if device is None:
            return None
        gen = _generator_for(device, kwargs.get("generator"))
        if gen is None:
            return None
        return gen, gen.get_state()

"""Producer tracking: which op made each tensor of the forward pass, from what.

While an Offloader whose policy may look at ``TensorInfo.op`` (a callable) or
may recompute is active, :class:`ProducerMode` (a ``TorchDispatchMode``, the
same mechanism PyTorch's selective checkpointing uses) sees every aten op the
forward runs and records, for each output tensor, a
:class:`~tiermem.tracking.records.Record`: the op's name and, for ops on the
recompute allow-list (tracking/ops.py), what is needed to run it again.
:class:`CallRecorder` names the torch call each op runs in, and records a
call whole where the profile saw it run one op (NOTE [Calls recorded whole]).
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

# Record, Ref, storage_key, the op sets and untracked_pack are re-exported: imported from
# here. The handler calls _run_as_without_mode through this module's globals
# (benchmarks/bench_tracking_own.py times it by replacing it here).
from .capture import capture_args, signature as _signature
from .dispatch import _run_as_without_mode, untracked_pack
from .hidden import opaque
from .modules import _compiling, call_name, current_module
from .ops import _RANDOM_NAMES, _VIEW_NAMES, RANDOM_OPS, RECOMPUTABLE_OPS, VIEW_OPS, _OpInfo
from .records import _PLAIN_TYPES, _STRIDED, Record, Ref, _refs, storage_key
from .rng import capture_rng, drew_nothing
from .writes import WriteWatch

__all__ = ["ProducerMode", "CallRecorder", "Record", "Ref", "call_name", "storage_key",
           "untracked_pack",
           "RECOMPUTABLE_OPS", "RANDOM_OPS", "VIEW_OPS"]

_aten = torch.ops.aten
_inference_mode = torch.is_inference_mode_enabled
_weakref = weakref.ref
#: What producer tracking knows of each op overload, shared by every mode
#: (an overload's schema never changes).
_OP_INFO: dict = {}


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


class ProducerMode(WriteWatch, TorchDispatchMode):
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
    [Recording only what recipes use]. The writes of the forward it watches
    for the recompute tier: :class:`~tiermem.tracking.writes.WriteWatch`."""

    tiermem_mode = True   # tracking/modestack.py

    # NOTE [The handler hidden from Dynamo]
    # PyTorch hides every dispatch mode's handler from Dynamo (its frame would
    # otherwise be compiled when an op dispatches inside a compiled function)
    # by wrapping it in ``torch._dynamo.disable``: about ten Python calls per
    # op, which the handler pays on every op of a tracked forward. The first
    # mode made hides it instead as the pack hooks are hidden (``opaque``:
    # frame evaluation off while it runs, two C calls), the same effect;
    # ``_should_skip_dynamo`` tells PyTorch not to wrap it too.
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __init__(self, module_names: bool = False, names: bool = True) -> None:
        if ProducerMode.__dict__["__torch_dispatch__"] is _RAW_HANDLER:
            # NOTE [The handler hidden from Dynamo]; two threads may both get
            # here: each hides the same handler, the same result.
            ProducerMode.__torch_dispatch__ = opaque(_RAW_HANDLER)
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
        self.last_op: Optional[_OpInfo] = None
        self.single_op_calls: dict = {}
        #: Op names to record (``None``: every recomputable op).
        self.wanted: Optional[frozenset] = None
        #: Ops handled so far (the next one's position). ``learned``: ``None``,
        #: or (the ``_OpInfo`` of each position, the positions to record ->
        #: (arguments' signature, whether in full)); ``diverged``: an op was
        #: another than learned; ``learning``: ``None``, or where a learning step
        #: keeps (``_OpInfo``, signature) of each op (NOTE [Records learned by
        #: position] in tiers/positions.py); ``kind``: ``None`` until the first
        #: op, then its (``_OpInfo``, signature); ``chooser``: the
        #: RecordPositions told of it (a step that may follow), else ``None``.
        self.position = 0
        self.ops_in_full = 0   # ops recorded in full (a recipe can run them)
        self.follows = False   # its step may follow learned positions
        self.kind: Optional[tuple] = None
        self.chooser = None
        self.learned: Optional[tuple] = None
        self.diverged = False
        self.learning: Optional[list] = None
        self._records: dict = {}    # id(tensor) -> (weakref to tensor, Record)

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

    def clear(self) -> None:
        self._records.clear()
        self._by_storage.clear()
        self._clear_watched()

    # -- recording ----------------------------------------------------------------
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
        position = self.position
        self.position = position + 1
        info = _OP_INFO.get(func)
        if info is None:
            info = _OP_INFO[func] = _OpInfo(func)
        counts = self.op_counts
        if counts is not None:
            key = (current_module(), self.call)
            counts[key] = counts.get(key, 0) + 1
            self.ops_run += 1
            self.last_op = info
        learning = self.learning
        if not position:   # the forward's kind: NOTE [Records learned by position], 4
            sig = _signature(args)
            self.kind = (info, sig)
            if self.chooser is not None:
                self.chooser.choose(self)
                learning = self.learning
            if learning is not None:
                learning.append((info, sig))
        elif learning is not None:   # a learning step: one entry per position
            learning.append((info, _signature(args)))
        if _inference_mode():   # inference tensors: nothing to record
            return _run_as_without_mode(func, types, args, kwargs)
        if info.written and (self._watched or self._watched_inputs):
            self._note_writes(info, args, kwargs)
        recomputable = info.recomputable
        learned = self.learned
        if learned is not None:   # NOTE [Records learned by position]
            ops, marks = learned
            mark = None
            if position < len(ops) and ops[position] is info:
                mark = marks.get(position)
                if mark is None:
                    return _run_as_without_mode(func, types, args, kwargs)
            if mark is None or mark[0] != _signature(args):
                self.learned, self.diverged = None, True   # rule 1: every op from here on
            elif not mark[1]:
                recomputable = False   # by name
        elif recomputable:
            wanted = self.wanted
            if wanted is not None and info.name not in wanted:
                recomputable = False
        records = self._records
        if not recomputable:
            if not self.names:   # NOTE [Recording only what recipes use]
                return _run_as_without_mode(func, types, args, kwargs)
            out = _run_as_without_mode(func, types, args, kwargs)
            values_op = info.name
            if info.view and args and isinstance(args[0], torch.Tensor):
                base = records.get(id(args[0]))
                if base is not None and base[0]() is args[0]:
                    values_op = base[1].values_op
            for o in (out if isinstance(out, (tuple, list)) else (out,)):
                if type(o) in _PLAIN_TYPES and o.layout is _STRIDED and not o.is_inference():
                    records[id(o)] = (_weakref(o), Record(info.name, values_op, version=o._version,
                                                          position=position))
            return out
        # Arguments are captured before the op runs (their versions then).
        captured = capture_args(records, args, kwargs)
        rng = None
        if captured is not None and info.random:
            rng = capture_rng(args, kwargs)
            if rng is None:
                captured = None
        out = _run_as_without_mode(func, types, args, kwargs)
        values_op = info.name
        if self.names and info.view and args and isinstance(args[0], torch.Tensor):
            base = records.get(id(args[0]))
            if base is not None and base[0]() is args[0]:
                values_op = base[1].values_op
        if captured is None:   # a name only
            func = rargs = rkwargs = None
        else:
            rargs, rkwargs = captured
            self.ops_in_full += 1
        if self.module_names:
            module, call = current_module(), self.call
        else:
            module = call = None
        multi = isinstance(out, (tuple, list))
        for i, o in enumerate(out if multi else (out,)):
            if type(o) not in _PLAIN_TYPES or o.layout is not _STRIDED or o.is_inference():
                continue   # not a tensor, or one the recompute tier cannot hold
            if func is None:
                rec = Record(info.name, values_op, version=o._version, position=position)
            else:
                rec = Record(info.name, values_op, func, rargs, rkwargs, i if multi else None,
                             rng, o._version, info.view, module, call, position)
                if self.alias_index:
                    self._index_alias(o, rec)
            records[id(o)] = (_weakref(o), rec)
        return out

    def _index_alias(self, o: torch.Tensor, rec: Record) -> None:
        """Index ``o`` (recorded by ``rec``) by storage and offset: NOTE [Views
        made inside untracked calls]."""
        if o.is_contiguous():
            key = (o.untyped_storage()._cdata, o.storage_offset())
            hit = self._by_storage.get(key)
            if hit is None or hit[0]() is None:
                self._by_storage[key] = (_weakref(o), rec)

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
    #    before it ran (``capture_rng``); unknown generator: not recorded;
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
        captured = None if _inference_mode() else capture_args(self._records, args, kwargs)
        rng = None
        if captured is not None:   # rules 5 and 6
            rng = capture_rng(args, kwargs)
            if rng is None:
                captured = None
        out = func(*args, **kwargs)
        if captured is None:
            return out
        if name not in _RANDOM_NAMES and drew_nothing(rng):   # rule 6
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
        module, call = (current_module(), call_name(func)) if self.module_names else (None, None)
        for i, o in enumerate(outs):
            if type(o) not in _PLAIN_TYPES or o.layout is not _STRIDED or o.is_inference():
                continue
            rec = Record(name, values_op, func, rargs, rkwargs, i if multi else None, rng,
                         o._version, view, module, call)
            if self.alias_index:
                self._index_alias(o, rec)
            records[id(o)] = (_weakref(o), rec)
        return out


#: The handler as written (NOTE [The handler hidden from Dynamo]).
_RAW_HANDLER = ProducerMode.__dict__["__torch_dispatch__"]

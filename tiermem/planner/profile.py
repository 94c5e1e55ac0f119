"""The planner's profile of one step: what each saved tensor is, when it was
saved and when backward first needed it.

The data: :class:`Profile` (records in pack order and the step's timeline),
:class:`TensorRecord`, :class:`BlockRecord` and :class:`BlockInput`, the step
signature (:func:`signature_key`, :func:`signature_hash`) and the pooling of
repeated layers' times (:func:`pool_repeated`). A
:class:`~tiermem.planner.recorder.Recorder` fills them during a profiled step
(planner/recorder.py; still importable from here).

Times are ``time.perf_counter()`` seconds from the step's start (the context's
entry), on CUDA read once the compute stream is done: NOTE [Profile times on
a GPU] in planner/recorder.py."""

from __future__ import annotations

import dataclasses
import hashlib
import re
import statistics
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from ..policy import Tier

__all__ = ["TensorRecord", "BlockInput", "BlockRecord", "Profile", "signature_key",
           "signature_hash", "INPUT_KINDS", "pool_repeated"]


#: What a checkpoint of an auto block would do with one of its tensor
#: arguments (``BlockInput.kind``; NOTE [Checkpointed block inputs] in
#: planner/runtime.py): ``"movable"`` (the planner may keep it
#: or move it), ``"param"`` (a parameter or a leaf that requires grad: never
#: moved, never counted), ``"small"`` / ``"unmovable"`` (kept by the pack
#: hook, counted as kept), ``"before"`` (its storage was saved earlier in the
#: step, by ``saved_as``: a dedup hit of that tensor), ``"after"`` (saved again
#: after the block by the rest of the step: kept, as before this option existed).
INPUT_KINDS = ("movable", "param", "small", "unmovable", "before", "after")


def signature_key(t) -> tuple:
    """What identifies a saved tensor's place in a step: (shape, dtype, device)."""
    return (t.shape, t.dtype, t.device)


def signature_hash(keys) -> str:
    """A short stable hash of a step signature (the keys in pack order)."""
    h = hashlib.sha1()
    for shape, dtype, device in keys:
        h.update(f"{tuple(shape)}|{dtype}|{device};".encode())
    return h.hexdigest()[:12]


# NOTE [Repeated layers share their timings]
# A profile times each auto block's forward and each recomputed tensor's
# regeneration once, on a host that may be busy, so one noisy time could
# decide which of several identical layers a plan checkpoints. Repeated layers
# do the same work, so ``Recorder.finish`` gives each such time the median of
# its kind (``pool_repeated``):
# - blocks: the same module path without layer indexes (``blocks.3`` ->
#   ``blocks.#``), the same saved tensors (shape, dtype, op, in order; not a
#   saved argument's op: it ran before the block) and the same arguments
#   (shape, dtype, kind);
# - recomputed tensors: the same module path without indexes, op, shape,
#   dtype, recipe ops (paths without indexes) and recipe input bytes kept.
# Only these durations, the costs the solver compares, are pooled; the
# timeline (``pack_s``, ``first_use_s``, ``start_s``) and byte counts stay as
# measured, and a kind seen once keeps its own time.
_LAYER_INDEX = re.compile(r"\.\d+(?=\.|$)")


def _layer_kind(module: str) -> str:
    """``module`` with its layer indexes removed: ``m.blocks.3.mlp`` -> ``m.blocks.#.mlp``."""
    return _LAYER_INDEX.sub(".#", module)


def pool_repeated(records: List["TensorRecord"], blocks: List["BlockRecord"]) -> None:
    """Give repeated layers' measured durations the median of their kind, in
    place (NOTE [Repeated layers share their timings])."""
    kinds: Dict[tuple, List[int]] = {}
    for i, r in enumerate(records):
        if r.recompute_s is not None:
            key = (_layer_kind(r.module), r.op, tuple(r.shape), r.dtype, r.input_kept_bytes,
                   tuple((_layer_kind(m), o) for m, o in r.recipe_ops))
            kinds.setdefault(key, []).append(i)
    for members in kinds.values():
        if len(members) > 1:
            mid = statistics.median(records[i].recompute_s for i in members)
            for i in members:
                records[i].recompute_s = mid
    kinds = {}
    for i, b in enumerate(blocks):
        inputs = {x.saved_as for x in b.inputs}   # made before the block: their ops differ
        key = (_layer_kind(b.module),
               tuple((tuple(r.shape), r.dtype, None if i in inputs else r.op)
                     for i, r in enumerate(records[b.start:b.end], b.start)),
               tuple((tuple(x.shape), x.dtype, x.kind) for x in b.inputs))
        kinds.setdefault(key, []).append(i)
    for members in kinds.values():
        if len(members) > 1:
            mid = statistics.median(blocks[i].forward_s for i in members)
            for i in members:
                blocks[i] = dataclasses.replace(blocks[i], forward_s=mid)


@dataclass
class TensorRecord:
    """One saved tensor of the profiled step (one that reached the policy:
    not a parameter, not small, not a dedup hit)."""

    index: int
    module: str
    op: Optional[str]
    shape: Tuple[int, ...]
    dtype: str
    device: str
    nbytes: int
    pack_s: float
    #: The tier that held it in the profile.
    profile_tier: str = Tier.KEEP.value
    #: Whether the recompute tier took it (its recipe was eligible).
    recomputable: bool = False
    #: Bytes its recipe's inputs added to the kept bytes (keep tail only).
    input_kept_bytes: int = 0
    #: Modules that ran its recipe's ops (NOTE [Scoped tracking] in tracking/modules.py).
    recipe_modules: Tuple[str, ...] = ()
    #: (module, op name) of each op of its recipe (NOTE [Recording only what
    #: recipes use] in tracking/producers.py).
    recipe_ops: Tuple[Tuple[str, str], ...] = ()
    #: (module, torch call) of each op of its recipe (``None``: outside every
    #: call; NOTE [Tracking inside torch calls] in tracking/modules.py).
    recipe_calls: Tuple[Tuple[str, Optional[str]], ...] = ()
    #: (module, torch call) of each op of its recipe whose output it uses was
    #: not returned by the call (NOTE [Calls recorded whole] in tracking/producers.py).
    recipe_unreturned: Tuple[Tuple[str, str], ...] = ()
    #: Host seconds its regeneration took in the profile's backward.
    recompute_s: Optional[float] = None
    #: Seconds from the step's start to its first unpack (``None``: never unpacked).
    first_use_s: Optional[float] = None
    #: Seconds its first unpack took in the profile (its read's wait, its
    #: regeneration), when no other unpack was running (``None``: inside
    #: another tensor's regeneration, or never unpacked): the profile's
    #: backward timeline less these is the compute's (see e of
    #: NOTE [Predicted restores] in planner/timeline.py).
    unpack_s: Optional[float] = None
    #: When a regeneration first read it as its recipe's input, if that came
    #: before its ``first_use_s`` (``None``: it did not), and the index of the
    #: tensor being regenerated: a followed step that recomputes that tensor
    #: needs this one then (NOTE [Predicted restores], e, in planner/timeline.py).
    leaf_use_s: Optional[float] = None
    leaf_reader: Optional[int] = None
    #: The ``hints`` callable's answer, ``(TierOrder, name)``, or ``None``
    #: (NOTE [Planner hints] in planner/hints.py).
    hint: Optional[tuple] = None


@dataclass
class BlockInput:
    """One tensor argument of an auto block in the profiled step: what a
    checkpoint of the block would save in its place (duplicates of an
    earlier argument are left out: a checkpoint saves them as dedup hits)."""

    #: Position among the block's positional arguments.
    arg: int
    shape: Tuple[int, ...]
    dtype: str
    device: str
    nbytes: int
    #: One of :data:`INPUT_KINDS`.
    kind: str
    #: The pack index of the tensor holding its storage in the profile: for
    #: ``"before"`` the earlier saver; for ``"movable"`` and ``"after"`` the
    #: first save inside the block (``None`` if the block never saved it).
    saved_as: Optional[int] = None


@dataclass
class BlockRecord:
    """One call of a ``wrap_blocks(..., checkpoint="auto")`` block in the
    profiled step (outermost ones only; NOTE [Blocks the planner may
    checkpoint] in planner/runtime.py). It ran plainly: its saved tensors are
    the records of pack indexes ``start`` to ``end - 1``, at pack positions
    ``start_pos`` to ``end_pos - 1``."""

    #: Order of the call among the step's auto blocks.
    index: int
    module: str
    start: int
    end: int
    start_pos: int
    end_pos: int
    #: Seconds its forward took in the profile: on the CPU the host's, less
    #: the time the profile's placements took in it (producer tracking is
    #: still in it); for CUDA inputs the GPU's (timing events).
    forward_s: float
    #: Bytes of its tensor arguments: what a checkpoint of it saves.
    input_bytes: int
    #: Seconds from the step's start to its entry (when a checkpoint of it
    #: saves its inputs).
    start_s: float = 0.0
    #: Its tensor arguments (``BlockInput``); empty: not recorded (every
    #: input then counts as kept).
    inputs: tuple = ()
    #: Kept bytes saved inside it that never reached the policy (small and
    #: unmovable tensors; part of ``Profile.fixed_kept_bytes``): a
    #: checkpoint of it does not keep them.
    fixed_bytes: int = 0
    #: The MUST policy of a wrap_blocks block that ran inside it (e.g.
    #: ``"MUST_SAVE"``), or None: a checkpoint of it would not obey that.
    must_inside: Optional[str] = None


@dataclass
class Profile:
    """A finished profile: records in pack order and the step's timeline."""

    records: List[TensorRecord]
    keys: tuple
    #: Bytes kept by the profiled step that never reach the policy (small and
    #: unmovable tensors): what any plan keeps anyway.
    fixed_kept_bytes: int
    forward_end_s: float
    backward_start_s: Optional[float]
    backward_end_s: Optional[float]
    #: bytes_by_tier['keep'] of the profiled step.
    measured_kept_bytes: int
    stats: dict = field(default_factory=dict)
    #: Per pack position: see ``Recorder.positions``.
    positions: tuple = ()
    #: The auto blocks of the step, in call order.
    blocks: tuple = ()
    #: Aten ops of the forward per (innermost module, outermost torch call;
    #: ``None``: outside every call), as the producer mode counted them: what
    #: tracking them costs (NOTE [Tracking priced] in planner/runtime.py);
    #: empty: not counted.
    call_ops: dict = field(default_factory=dict)
    #: Per (module, torch call) whose every call ran one recomputable op:
    #: that op's name (NOTE [Calls recorded whole] in tracking/producers.py).
    single_op_calls: dict = field(default_factory=dict)

    @property
    def baseline_bytes(self) -> int:
        """Saved bytes a plain step keeps: every record plus the fixed part."""
        return self.fixed_kept_bytes + sum(r.nbytes for r in self.records)

    @property
    def signature(self) -> str:
        return signature_hash(self.keys)


def __getattr__(name: str):
    """``Recorder``, from planner/recorder.py (it imports this module, so it is
    looked up on first use)."""
    if name == "Recorder":
        from .recorder import Recorder
        return Recorder
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

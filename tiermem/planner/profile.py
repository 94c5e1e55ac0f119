"""The planner's profile of one step: what each saved tensor is, when it was
saved and when backward first needed it.

A :class:`Recorder` is attached to a step run under the *safe* placement (see
NOTE [Profile under the safe order] in planner/runtime.py). The pack hook
reports each tensor that reaches the policy (:meth:`Recorder.record`, then
:meth:`Recorder.placed` with the handle the tiers gave), and the step's unpack
hook is :meth:`Recorder.unpack`, which stamps the first unpack of each handle
and times the regeneration of recomputed ones. Only profiled steps pay for
this: other steps use the plain unpack hook.

Times are ``time.perf_counter()`` seconds from the step's start (the context's
entry). On CUDA they are host times: kernels run ahead of the host, so a
window read here is the host's view (the profile of a GPU step is not
calibrated yet: no GPU run has been made).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from ..policy import Tier
from ..tiers.keep import Kept
from ..tiers.recompute import RecomputeHandle

__all__ = ["TensorRecord", "Profile", "Recorder", "signature_key", "signature_hash"]


def signature_key(t) -> tuple:
    """What identifies a saved tensor's place in a step: (shape, dtype, device)."""
    return (t.shape, t.dtype, t.device)


def signature_hash(keys) -> str:
    """A short stable hash of a step signature (the keys in pack order)."""
    h = hashlib.sha1()
    for shape, dtype, device in keys:
        h.update(f"{tuple(shape)}|{dtype}|{device};".encode())
    return h.hexdigest()[:12]


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
    #: Modules that ran its recipe's ops (NOTE [Scoped tracking] in tracker.py).
    recipe_modules: Tuple[str, ...] = ()
    #: Host seconds its regeneration took in the profile's backward.
    recompute_s: Optional[float] = None
    #: Seconds from the step's start to its first unpack (``None``: never unpacked).
    first_use_s: Optional[float] = None
    #: The ``hints`` callable's answer, ``(TierOrder, name)``, or ``None``
    #: (NOTE [Planner hints] in planner/hints.py).
    hint: Optional[tuple] = None


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

    @property
    def baseline_bytes(self) -> int:
        """Saved bytes a plain step keeps: every record plus the fixed part."""
        return self.fixed_kept_bytes + sum(r.nbytes for r in self.records)

    @property
    def signature(self) -> str:
        return signature_hash(self.keys)


class Recorder:
    """Records one profiled step (see the module docstring). Forward calls
    come from the pack hook's thread; :meth:`unpack` from autograd's."""

    def __init__(self, unpack) -> None:
        self.t0 = time.perf_counter()
        self.stats = None
        self._unpack = unpack
        self.records: List[TensorRecord] = []
        self.keys: list = []
        #: Per pack position (NOTE [Following a plan] in planner/runtime.py):
        #: ``i`` a new tensor of index ``i``; ``~i`` a dedup hit of index ``i``;
        #: ``None`` a dedup hit of a handle this step did not record.
        self.positions: list = []
        self._by_handle: Dict[int, int] = {}
        self._recompute_handles: set = set()
        self._kept_before = 0
        self._inputs_before = 0
        self._recorded_kept = 0
        self.forward_end_s: Optional[float] = None
        self.fixed_kept_bytes = 0
        self.measured_kept_bytes = 0
        self.first_unpack_s: Optional[float] = None
        self.last_unpack_s: Optional[float] = None

    def start(self, stats) -> None:
        """The step starts now; its stats are ``stats``."""
        self.stats = stats
        self.t0 = time.perf_counter()

    # -- forward -------------------------------------------------------------------
    def record(self, index: int, t, nbytes: int, module: str, op: Optional[str],
               hint: Optional[tuple] = None) -> None:
        """Tensor ``index`` is about to be placed (``hint``: see TensorRecord)."""
        self.records.append(TensorRecord(
            index, module, op, tuple(t.shape), str(t.dtype).replace("torch.", ""),
            str(t.device), nbytes, time.perf_counter() - self.t0, hint=hint))
        self.keys.append((t.shape, t.dtype, t.device))
        self.positions.append(index)
        by = self.stats.bytes_by_tier
        self._kept_before = by[Tier.KEEP.value]
        self._inputs_before = self.stats.recompute_input_bytes

    def placed(self, index: int, handle: Any) -> None:
        """Tensor ``index`` got ``handle`` (the put just made)."""
        rec = self.records[index]
        kept_delta = self.stats.bytes_by_tier[Tier.KEEP.value] - self._kept_before
        self._recorded_kept += kept_delta
        if type(handle) is RecomputeHandle:
            rec.profile_tier = Tier.RECOMPUTE.value
            rec.recomputable = True
            rec.input_kept_bytes = kept_delta   # its recipe's inputs left on the device
            rec.recipe_modules = handle.modules
            self._recompute_handles.add(id(handle))
        elif type(handle) is Kept:
            rec.profile_tier = Tier.KEEP.value
        else:
            rec.profile_tier = handle.store.tier.value
        self._by_handle[id(handle)] = index

    def hit(self, handle: Any) -> None:
        """The tensor at the next pack position was a dedup hit of ``handle``."""
        index = self._by_handle.get(id(handle))
        self.positions.append(None if index is None else ~index)

    def end_forward(self) -> None:
        self.forward_end_s = time.perf_counter() - self.t0
        kept = self.stats.bytes_by_tier[Tier.KEEP.value]
        self.measured_kept_bytes = kept
        self.fixed_kept_bytes = max(0, kept - self._recorded_kept)

    # -- backward ------------------------------------------------------------------
    def unpack(self, handle: Any):
        """The unpack hook of a profiled step: the plain unpack, timed."""
        now = time.perf_counter() - self.t0
        if self.first_unpack_s is None:
            self.first_unpack_s = now
        index = self._by_handle.get(id(handle))
        if index is None or self.records[index].first_use_s is not None:
            out = self._unpack(handle)
        else:
            rec = self.records[index]
            rec.first_use_s = now
            if id(handle) in self._recompute_handles:
                start = time.perf_counter()
                out = self._unpack(handle)
                rec.recompute_s = time.perf_counter() - start
            else:
                out = self._unpack(handle)
        self.last_unpack_s = time.perf_counter() - self.t0
        return out

    @property
    def backward_seen(self) -> bool:
        return self.first_unpack_s is not None

    def finish(self) -> Profile:
        """The profile, once backward has run (or as far as it has)."""
        if self.forward_end_s is None:
            self.end_forward()
        return Profile(self.records, tuple(self.keys), self.fixed_kept_bytes,
                       self.forward_end_s, self.first_unpack_s, self.last_unpack_s,
                       self.measured_kept_bytes, self.stats.as_dict(),
                       tuple(self.positions))

"""The ``recompute`` tier: drop a saved tensor, regenerate it in backward.

A saved tensor is recomputable when its producer op is on the allow-list
(:data:`~tiermem.tracking.producers.RECOMPUTABLE_OPS`) and the op's inputs can be had
again in backward. ``put`` plans a *recipe*: a small tree whose root is the
producer op and whose leaves are handles of tensors tiermem stores anyway.
"""

# NOTE [What a recipe holds]
# A recipe holds no tensor the program may still change, and a tensor is dropped
# only if its recipe stores fewer bytes than it frees. For each tensor argument
# of a recorded op, in this order of preference:
# 1. a tensor this step already saved (a dedup hit): its handle is shared;
# 2. a parameter (or a leaf that requires grad): held as is, checked for changes
#    (NOTE [Parameters changed before backward] in tracking/params.py); buffers go
#    through 4;
# 3. the argument's own recipe, when its producer is recomputable and that stores
#    fewer bytes than 4;
# 4. a copy of the argument (``exact_copy``: sizes, strides, alignment), stored in
#    the tiers the policy lists after recompute and registered for dedup.
# The bytes of case 4 are the recipe's cost. An input gone (freed, or modified in
# place since the op ran) makes the tensor not eligible: the policy's next choice.
# Gapped views are not inputs: a view op replayed on a dense copy gives other strides.

# NOTE [Recompute is exact]
# The op is run again on inputs equal to the originals in values, sizes,
# strides and alignment (see NOTE [Layout of a moved tensor]), under
# ``no_grad`` and without autocast, so the same kernel computes the same bits.
# Random ops replay the generator state captured just before they ran and
# restore the generator afterwards, so backward's own random numbers (none in
# PyTorch's built-in backward formulas) and the next step are not disturbed.
# If the saved tensor itself is still alive at unpack (someone else kept it),
# it is returned as is: nothing was freed, and nothing needs computing.

# NOTE [Recomputed for consumers on several streams]
# A tensor saved by several ops is regenerated once per backward pass, by the
# first unpack, on that consumer's current stream, and kept for the others
# (``more_uses``). On CUDA the ops of one forward may run on several streams
# and autograd runs each backward op on its forward op's stream, so a later
# consumer may be on another stream than the one the recipe's kernels were
# queued on: it would read the tensor before they finish, and the caching
# allocator could hand its block to the producer stream once the cache lets
# go. So the kept tensor carries an event recorded after the recipe
# (:class:`_Cached`); a consumer on another stream waits for it (a GPU-side
# wait, no host sync) and ``record_stream``-s the tensor on its own stream,
# as the moving tiers order a restore for each of its consumers.

from __future__ import annotations

import time
import weakref
from typing import Any, Optional, Tuple

import torch

from ..errors import TierMemError
from ..policy import Tier
from ..tracking.producers import Record, Ref
from .base import Layout, RecipeServices, TierStore, exact_copy
from .positions import NO_PRODUCER, NOT_RECORDED, RecordPositions
from .refusals import Kinds, Refusals
from .replay import _Cached, _no_autocast
from .keep import Kept

__all__ = ["RecomputeStore", "RecomputeHandle", "MAX_RECIPE_NODES", "MAX_RECIPE_DEPTH"]

#: Largest number of ops one recipe may run (bounds planning and backward cost).
MAX_RECIPE_NODES = 32

#: Longest chain of recipes whose inputs are other dropped tensors (NOTE
#: [Depth of recipe chains]).
MAX_RECIPE_DEPTH = 16

# NOTE [Depth of recipe chains]
# A recipe's input may be a tensor the step dropped too (NOTE [What a recipe
# holds], case 1): regenerating it first regenerates that input, whose recipe
# may need another dropped tensor, and so on. In a chain of pointwise ops
# (``y = y.sin()`` n times: each op saves its input) every tensor would need
# all the earlier ones: the first unpack in backward would recurse n levels
# (Python's recursion limit: measured to fail near 150 levels) and hold every
# regenerated tensor at once (the memory recompute was to save). So each
# handle has a ``depth``: 1 + the largest depth of the dropped tensors its
# recipe reads (1 when it reads none). A tensor whose depth would exceed
# MAX_RECIPE_DEPTH is not recomputed (``stats.recompute_fallbacks``, reason
# "chain too deep") and goes to its policy's next tier; the chain starts again
# after it. Backward then regenerates at most MAX_RECIPE_DEPTH tensors for one
# unpack, and a chain keeps one tensor in MAX_RECIPE_DEPTH + 1.


class _Node:
    """One op of a recipe; ``args``/``kwargs`` hold handles, nodes and plain values."""

    __slots__ = ("func", "args", "kwargs", "out_index", "rng")


class _In:
    """A leaf of a recipe: a handle of a tier (unpacked through its store).
    ``watch``: for a parameter held as it is, what it was at pack (checked
    before each recompute; NOTE [Parameters changed before backward] in
    tracking/params.py), else ``None``."""

    __slots__ = ("handle", "watch", "__weakref__")

    def __init__(self, handle, watch=None) -> None:
        self.handle = handle
        self.watch = watch

    def snapshot(self, copies: dict) -> None:
        """The parameter or leaf this leaf holds as it is is about to be written
        in place during the forward: hold a copy of its values of now instead
        (NOTE [Writes to recipe inputs] in tracking/writes.py). ``copies``: the
        copies made for this write, by tensor, shared by every leaf."""
        h = self.handle
        if type(h) is not Kept or h.tensor._version != h.version:
            return   # a copy already, or changed unseen: its unpack will say so
        if self.watch is not None:   # a copy from now on: nothing to check
            self.watch.stale = True
            self.watch = None
        t = h.tensor
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.size()), t.stride())
        copy = copies.get(key)
        if copy is None:
            copy = copies[key] = Kept(exact_copy(h.tensor), h.module)
        self.handle = copy


class RecomputeHandle:
    """A dropped saved tensor and its recipe. Owned by autograd."""

    __slots__ = ("store", "step", "entry", "plan", "size", "stride", "dtype", "module",
                 "nbytes", "version", "src_ref", "data_ptr", "cached", "tainted", "depth",
                 "modules", "ops", "calls", "call_records", "__weakref__")


class _Plan:
    """Planning state of one ``put``: leaves chosen, bytes they cost."""

    def __init__(self) -> None:
        self.cost_bytes = 0
        self.nodes = 0
        self.depth = 0             # largest depth of the dropped tensors read (NOTE [Depth of recipe chains])
        self.to_store: dict = {}   # id(tensor) -> tensor, stored if the plan is taken

    def store(self, t: torch.Tensor) -> None:
        if id(t) not in self.to_store:
            self.to_store[id(t)] = t
            self.cost_bytes += t.numel() * t.element_size()


class _Ineligible(Exception):
    def __init__(self, reason: str) -> None:
        self.reason = reason


class RecomputeStore(TierStore):
    """Plans recipes at ``put`` and runs them at ``take``. See the module docstring.

    ``step`` is the :class:`~tiermem.tiers.base.RecipeServices` of the step
    being packed: it is all a recipe may ask of the rest of tiermem."""

    tier = Tier.RECOMPUTE

    def __init__(self) -> None:
        kinds = Kinds()   # NOTE [Records learned by position], 4
        #: NOTE [Refusals remembered] in tiers/refusals.py.
        self.refusals = Refusals(kinds)
        #: NOTE [Records learned by position] in tiers/positions.py.
        self.positions = RecordPositions(kinds)

    # -- forward ----------------------------------------------------------------
    def put(self, t: torch.Tensor, step: RecipeServices, module: str = "",
            later: Tuple[Tier, ...] = (), must: bool = False) -> Optional[RecomputeHandle]:
        """A handle whose recipe regenerates ``t``, or ``None`` if ``t`` is not
        eligible. ``later``: the tiers after recompute in ``t``'s order, where
        the recipe's own inputs are stored (keep if none). ``must``: the policy
        answered ``CheckpointPolicy.MUST_RECOMPUTE``; a tensor that is not
        eligible raises ``TierMemError`` naming its op, module and the reason
        instead (NOTE [CheckpointPolicy answers] in policy.py)."""
        producers = step.producers
        rec = None if producers is None else producers.record_of(t)
        nbytes = t.numel() * t.element_size()
        refusals = self.refusals
        kind, ops_before = (None, -1) if producers is None else (producers.kind,
                                                                 producers.position)
        key = refusals.key(step, kind, None if rec is None else rec.name, nbytes, module,
                           ops_before)
        known = None if must else refusals.known(key)   # NOTE [Refusals remembered]
        positions = self.positions   # NOTE [Records learned by position]
        if positions.active:
            positions.candidate(rec)
        if (known is None and (rec is None or rec.func is None) and producers is not None
                and producers.learned is not None):
            # Rule 2. Once the mode records every op (rule 1) a candidate is planned
            # as in a learning step: a key changed at a position recorded by name
            # means other arguments there (an op's output shape follows from them).
            positions.missed()
            known = (refusals.known(key, due_too=True)
                     or (NO_PRODUCER if rec is None else NOT_RECORDED))
        if known is not None:
            step.not_recomputable(known)
            return None
        try:
            if rec is None:
                raise _Ineligible(NO_PRODUCER)
            if rec.func is None:
                raise _Ineligible(f"op {rec.name} is not recomputable")
            plan = _Plan()
            self._check(rec, step, plan, 0)
            if plan.depth >= MAX_RECIPE_DEPTH:
                raise _Ineligible("chain too deep (its recipe would regenerate "
                                  f"{MAX_RECIPE_DEPTH} dropped tensors first)")
            if plan.cost_bytes >= nbytes:
                raise _Ineligible("its inputs cost as much memory as it frees")
        except _Ineligible as e:
            if must:
                op = "no recorded op" if rec is None else f"op {rec.name}"
                seen = producers.op_name(t) if producers is not None else None
                if rec is not None and seen and seen != rec.name:
                    op = f"op {seen} (through {rec.name})"   # what TensorInfo.op said
                raise TierMemError(
                    f"tiermem: the policy answered CheckpointPolicy.MUST_RECOMPUTE for a tensor "
                    f"(shape {list(t.shape)}, {t.dtype}, made by {op}"
                    f"{', in module ' + module if module else ''}) that cannot be recomputed: "
                    f"{e.reason}. Answer PREFER_RECOMPUTE to let such tensors go to the next "
                    "tier instead, or another tier for them") from None
            refusals.refused(key, e.reason)
            step.not_recomputable(e.reason)
            return None
        stored = {}
        for key, x in plan.to_store.items():
            stored[key] = step.store_input(x, later)
        step.recipe_inputs_stored(plan.cost_bytes)
        h = RecomputeHandle()
        as_is: list = []
        ops: list = []
        h.plan = self._build(rec, step, stored, as_is, ops)
        self.positions.used(ops)
        if (ops and h.plan.args and type(h.plan.args[0]) is _Node and ops[0][0] is not None
                and producers.alias_of(t, rec)):
            # A view of a tensor the recipe regenerates: a scoped step makes
            # its record itself (NOTE [Views made inside untracked calls] in
            # tracking/producers.py), so the op that made it need not be tracked.
            del ops[0]
        #: (module, op name) of each op of the recipe, the modules alone, and
        #: (module, torch call) of each (recorded by a mode with
        #: module_names: NOTE [Scoped tracking] and NOTE [Tracking inside
        #: torch calls] in tracking/modules.py, NOTE [Recording only what recipes use]
        #: in tracking/producers.py), else ().
        known = not any(m is None for m, _, _, _ in ops)
        h.ops = tuple(sorted({(m, o) for m, o, _, _ in ops})) if known else ()
        h.modules = tuple(sorted({m for m, _ in h.ops}))
        h.calls = (tuple(sorted({(m, c) for m, _, c, _ in ops},
                                key=lambda mc: (mc[0], mc[1] or "")))
                   if known else ())
        #: (module, torch call, Record) of each op of the recipe run inside a
        #: call: whether the call returned the output the recipe uses is
        #: known once the call has returned (``Record.returned``, after this
        #: put when the call saves its own output): NOTE [Calls recorded
        #: whole] in tracking/producers.py.
        h.call_records = (tuple((m, c, r) for m, _, c, r in ops if c is not None)
                          if known else ())
        h.store, h.step, h.module = self, step, module
        h.size, h.stride, h.dtype = t.size(), t.stride(), t.dtype
        h.nbytes = nbytes
        h.version = t._version
        h.src_ref = weakref.ref(t)
        h.data_ptr = t.untyped_storage().data_ptr()
        h.cached = None
        h.tainted = False
        h.depth = plan.depth + 1
        h.entry = step.dropped(h, nbytes)
        producers.watch(t, h)   # NOTE [Writes to dropped tensors] in tracking/writes.py
        for x, leaf in as_is:   # NOTE [Writes to recipe inputs] in tracking/writes.py
            producers.watch_input(x, leaf)
        return h

    def _check(self, rec: Record, step, plan: _Plan, depth: int) -> None:
        """Decide, for each argument of ``rec``, how the recipe will get it (see
        NOTE [What a recipe holds]); raise :class:`_Ineligible` if it cannot."""
        plan.nodes += 1
        if plan.nodes > MAX_RECIPE_NODES:
            raise _Ineligible("its recipe would run too many ops")
        for ref in rec.refs():
            self._choose(ref, step, plan, depth)

    def _choose(self, ref: Ref, step, plan: _Plan, depth: int) -> None:
        saved = step.lookup(ref)
        if _usable(saved):
            if type(saved) is RecomputeHandle and saved.depth > plan.depth:
                plan.depth = saved.depth
            return
        x = ref.alive()
        if x is not None:
            if step.is_stable_param(x) or step.is_small(x):
                return
        sub = ref.record
        if sub is not None and sub.func is not None and sub.version == ref.version:
            trial = _Plan()
            trial.nodes, trial.to_store = plan.nodes, dict(plan.to_store)
            trial.cost_bytes, trial.depth = plan.cost_bytes, plan.depth
            try:
                self._check(sub, step, trial, depth + 1)
            except _Ineligible:
                trial = None
            if trial is not None and (x is None or trial.cost_bytes - plan.cost_bytes < ref.nbytes):
                plan.nodes, plan.to_store, plan.cost_bytes, plan.depth = (
                    trial.nodes, trial.to_store, trial.cost_bytes, trial.depth)
                return
        if x is None:
            raise _Ineligible("an input was freed or modified in place")
        if not x.is_contiguous() and Layout.of(x).compact:
            raise _Ineligible("an input is a gapped view")
        plan.store(x)

    def _build(self, rec: Record, step, stored: dict, as_is: list, modules: list) -> _Node:
        """Materialise the plan chosen by :meth:`_check` (same order of choices);
        appends to ``modules`` the (module, op name, torch call, record) of
        each op it runs, this one first."""
        modules.append((rec.module, rec.name, rec.call, rec))
        node = _Node()
        node.func, node.out_index, node.rng = rec.func, rec.out_index, rec.rng
        node.args = tuple(self._arg(a, step, stored, as_is, modules) for a in rec.args)
        node.kwargs = {k: self._arg(v, step, stored, as_is, modules)
                       for k, v in rec.kwargs.items()}
        return node

    def _arg(self, a: Any, step, stored: dict, as_is: list, modules: list) -> Any:
        if type(a) is list:
            return [self._arg(x, step, stored, as_is, modules) for x in a]
        if type(a) is not Ref:
            return a
        x = a.alive()
        h = None if x is None else stored.pop(id(x), None)
        if h is not None:
            return _In(h)     # stored for this recipe: its first use is this one
        h = step.lookup(a)
        if _usable(h):
            step.share(h)
            return _In(h)
        if x is not None:
            if step.is_stable_param(x):
                held = step.keep_handle(x, clone=False)
                leaf = _In(held, step.watch_param(held.tensor))
                as_is.append((x, leaf))
                return leaf
            if step.is_small(x):
                return _In(step.keep_handle(x, clone=True))
        return self._build(a.record, step, stored, as_is, modules)

    # -- backward -----------------------------------------------------------------
    def take(self, h: RecomputeHandle, more_uses: int):
        """``(tensor, None)``, or ``(None, finish)`` where ``finish()`` runs the
        recipe (outside the prefetcher's lock: it unpacks its inputs) and keeps
        the result for the ``more_uses`` uses still to come in this pass."""
        src = h.src_ref()
        if h.tainted or (src is not None and src._version != h.version):
            raise TierMemError(
                f"tiermem: a tensor saved for backward (shape {list(h.size)}, {h.dtype}"
                f"{' in module ' + h.module if h.module else ''}) was modified by an "
                "in-place operation after it was saved; autograd would raise here too. "
                "Clone it before modifying it, or do the in-place operation out of place.")
        if src is not None and src.untyped_storage().data_ptr() == h.data_ptr:
            # Still alive: nothing was freed. NOTE [Recompute is exact]. (A
            # storage resized since, FSDP2's free of an unsharded parameter's
            # memory under an alias of it, no longer holds the values: rule 5
            # of NOTE [Sharded parameters] in runtime/hooks.py.)
            return src.detach(), None
        cached = h.cached
        if cached is not None:
            if more_uses <= 0:
                h.cached = None
            return cached.for_current_stream(), None
        return None, _Recompute(h, more_uses)


class _Recompute:
    """``finish`` of an unpack that regenerates its tensor."""

    __slots__ = ("h", "more_uses")

    def __init__(self, h: RecomputeHandle, more_uses: int) -> None:
        self.h, self.more_uses = h, more_uses

    def __call__(self) -> torch.Tensor:
        h = self.h
        t0 = time.perf_counter()
        try:
            with torch.no_grad(), _no_autocast():
                out = _run(h.plan, h.step)
                if out.size() != h.size or out.dtype != h.dtype:
                    raise RuntimeError(f"got {list(out.size())} {out.dtype}")
                if out.stride() != h.stride:
                    # Same values; give backward the layout it saved.
                    out = torch.empty_strided(h.size, h.stride, dtype=out.dtype,
                                              device=out.device).copy_(out)
        except TierMemError:
            raise
        except Exception as e:
            raise TierMemError(
                f"tiermem: recomputing a saved tensor (shape {list(h.size)}, {h.dtype}"
                f"{' in module ' + h.module if h.module else ''}) failed: {e}") from e
        h.step.recomputed(time.perf_counter() - t0)
        if self.more_uses > 0:
            h.cached = _Cached(out)   # for the other saves of this tensor in this pass
        return out


def _usable(h: Any) -> bool:
    """A saved handle a recipe can take its input from: not a gapped view that
    a moving tier restores as a dense copy (other strides)."""
    layout = getattr(h, "layout", None)
    return h is not None and (layout is None or not layout.compact)


def _value(a: Any, step) -> Any:
    if type(a) is _In:
        if a.watch is not None:
            step.check_param(a.watch)
        return step.unpack(a.handle)   # the unpack hook's own path, for every kind
    if type(a) is _Node:
        return _run(a, step)
    if type(a) is list:
        return [_value(x, step) for x in a]
    return a


def _run(node: _Node, step) -> torch.Tensor:
    args = tuple(_value(a, step) for a in node.args)
    kwargs = {k: _value(v, step) for k, v in node.kwargs.items()}
    if node.rng is None:
        out = node.func(*args, **kwargs)
    else:
        gen, state = node.rng
        now = gen.get_state()
        gen.set_state(state)
        try:
            out = node.func(*args, **kwargs)
        finally:
            gen.set_state(now)
    return out if node.out_index is None else out[node.out_index]

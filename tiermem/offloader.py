"""The public surface: :class:`Offloader` and the step it runs,
:class:`OffloadContext` (the one-shot :func:`~tiermem.offload` and
:func:`~tiermem.no_offload`: ``oneshot.py``; attaching to a module: ``attach.py``).

How a saved tensor travels (each arrow owned by one module)::

    forward                                     backward
    -------                                     --------
    autograd saves t                            autograd needs t
      | hooks.Packer (pack)                       | hooks.unpack
      v                                           v
    placement.Placement.put  (policy / plan)    prefetch.Prefetcher.begin_use
      | tiers/<tier>.put                          | tiers/<tier>.take (restore, or recipe)
      v                                           | prefetch.Prefetcher.advance
    handle  --(job lands: tiers/moving.poll)-->   |   (tiers/<tier>.prefetch ahead of need)
      |                                           v
      +--> autograd holds it until backward     finish(): jobs wait, then t

An :class:`OffloadContext` is one step: it makes the :class:`~tiermem.runtime.step.Step`
(stats, dedup, prefetch schedule) and its :class:`~tiermem.runtime.hooks.Packer`, and
installs the hooks while the forward pass runs. The :class:`Offloader` holds
what lasts across steps: the settings and the
:class:`~tiermem.runtime.placement.Placement` (stores, pools, files).
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from typing import Any, Callable, Optional

import torch

from .attach import Attachment, attach_module, detach_modules
from .blocks import (BLOCK_SCOPE, blocks_need_full_tracking, blocks_need_producers,
                     blocks_with_policy)
from .config import Config
from .deciders import check_hints, make_decider
from .errors import TierMemError
from .policy import Tier
from .tracking.hidden import hidden_hook
from .runtime.hooks import Packer, opaque, unpack
from .runtime.keephooks import keep_step_hooks
from .runtime.placement import Placement
from .runtime.roots import RootWalks
from .runtime.schedule import BackwardOrder
from .runtime.step import Step
from .runtime.tailhold import TailHold
from .telemetry import StepStats
from .tracking.modules import ModuleStack, TrackingScope, release
from .tracking.producers import ProducerMode, untracked_pack
from .tracking.setup import step_tracking

__all__ = ["Offloader", "OffloadContext"]

_log = logging.getLogger("tiermem")

class OffloadContext(torch.autograd.graph.saved_tensors_hooks):
    """One step of an :class:`Offloader`: the forward pass under ``with``, and the
    backward that consumes its saved tensors. ``stats`` holds what it did."""

    def __init__(self, offloader: "Offloader") -> None:
        self._off = offloader
        placement = offloader._placement
        decider = offloader._decider
        #: The step's decider (a ``StepDecider``, tiermem/deciders.py), or None:
        #: asked through its methods only.
        self.planning = planning = decider.begin_step()
        tracks = decider.tracking(planning)   # what this step tracks
        #: Producer of each tensor of the forward (None unless the policy may
        #: recompute or is a callable that may read ``TensorInfo.op``); where
        #: tracking runs when it is scoped (``None``: the whole forward, or not
        #: at all); a profiled step's namer of torch calls.
        self.producers: Optional[ProducerMode]
        self.tracking: Optional[TrackingScope]
        self.producers, self.tracking, self._calls = step_tracking(
            tracks, blocks_need_full_tracking(), blocks_need_producers())
        prefetch_bytes = offloader.config.prefetch_bytes
        if prefetch_bytes is None and planning is not None:
            prefetch_bytes = planning.prefetch_bytes()
        observers = () if planning is None else planning.observers()
        self.step = Step(placement, prefetch_bytes,
                         offloader.config.min_offload_bytes, self.producers, unpack,
                         check_params=offloader.config.check_params, observers=observers)
        self.step.join(offloader._order)   # NOTE [Backward order] in runtime/schedule.py
        self.stats = self.step.stats
        tail_hold_bytes = offloader.config.tail_hold_bytes
        limit = tail_hold_bytes if tail_hold_bytes is not None else prefetch_bytes
        if planning is None and limit != 0:   # NOTE [Tail hold] in runtime/tailhold.py
            self.step.tail = offloader._tail
            self.step.tail_hold_bytes = tail_hold_bytes
        keeps_all = (planning is None and placement.fixed is Tier.KEEP
                     and self.producers is None and not blocks_with_policy())
        self._packer = Packer(self.step, placement, BLOCK_SCOPE, offloader._roots, planning,
                              keeps_all=keeps_all)
        #: The module tracker (None: NOTE [Steps that keep everything]).
        self._modules: Optional[ModuleStack] = None
        if not keeps_all:
            self._modules = ModuleStack(self._packer.note_root, self.tracking, holder=offloader)
        else:   # it holds them no more, if an earlier step of it needed them
            release(offloader)
        for o in observers:   # e.g. a profile: the forward begins now
            o.started(self.step)
        if keeps_all:   # NOTE [Hooks of a step that keeps everything] in runtime/keephooks.py
            super().__init__(*keep_step_hooks(self.step, offloader.config.min_offload_bytes))
            return
        hook = self.step.unpack_hook
        unpack_hook = hidden_hook("unpack", unpack) if hook is unpack else opaque(hook)
        pack = self._packer.__call__
        if self.producers is not None:   # NOTE [The pack hook runs untracked] in tracking/dispatch.py
            pack = untracked_pack(self.producers, pack)
        super().__init__(opaque(pack), unpack_hook)

    @property
    def prefetcher(self):
        """This step's :class:`~tiermem.runtime.prefetch.Prefetcher`."""
        return self.step.prefetcher

    def __enter__(self) -> "OffloadContext":
        modules = self._modules
        if modules is not None:
            modules.__enter__()
        try:
            super().__enter__()
            try:
                if self.producers is not None and self.tracking is None:
                    self.producers.__enter__()
                    if self._calls is not None:
                        try:
                            self._calls.__enter__()
                        except BaseException:
                            self.producers.__exit__(None, None, None)
                            raise
            except BaseException:
                super().__exit__(None, None, None)
                raise
            BLOCK_SCOPE.contexts.append(self)   # what checkpoint="auto" blocks ask
        except BaseException:
            if modules is not None:
                modules.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if self.producers is not None and self.tracking is None:
                try:
                    if self._calls is not None:
                        self._calls.__exit__(exc_type, exc, tb)
                finally:
                    try:
                        self.producers.__exit__(exc_type, exc, tb)
                    finally:
                        self.producers = None
        finally:
            self._exit_hooks(exc_type, exc, tb)

    def _exit_hooks(self, exc_type, exc, tb) -> None:
        contexts = BLOCK_SCOPE.contexts
        for i in range(len(contexts) - 1, -1, -1):
            if contexts[i] is self:
                del contexts[i]
                break
        failed = exc_type is not None
        planning = self.planning
        _run_all(   # NOTE [Every exit step runs]
            lambda: torch.autograd.graph.saved_tensors_hooks.__exit__(self, exc_type, exc, tb),
            lambda: self._modules is None or self._modules.__exit__(exc_type, exc, tb),
            lambda: self._off._decider.end_step(planning, self.stats, failed),
            lambda: self.step.end_forward(failed),
            self._packer.clear,
            lambda: self._off._exit(self, failed=failed))


# NOTE [Steps that keep everything]
# A step that keeps every tensor (fixed ``keep``, no producers, no plan, no
# live wrapped block with a policy) runs without the module tracker: module
# names and roots serve only placing, recipes and the errors of moved
# tensors, and its global hooks put every module call on torch's slow path.
# Nor does its pack hook poll the moving tiers. Without roots its stats tell a
# buffer from an activation by type only: a saved buffer counts as kept.


# NOTE [Every exit step runs]
# Leaving a step's context undoes several things in order (the hooks, the
# module stack, the planner's end of forward, the step's, the Offloader's
# launch or drain and its "active" mark). An exception in one of them, or a
# KeyboardInterrupt landing there (a second Ctrl-C while the exit drains slow
# copies after the first), must not skip the others: a skipped reset left the
# Offloader "already active in this thread" for good, every later ``with``
# refused. So each runs whatever the earlier ones did, and the first error is
# raised once all have run (``_run_all``); ``Offloader._exit`` clears its
# active mark in a ``finally``.
def _run_all(*steps: Callable[[], Any]) -> None:
    """Call each of ``steps`` in order, even after one raised (any
    ``BaseException``); then raise the first error, if any."""
    first: Optional[BaseException] = None
    for run in steps:
        try:
            run()
        except BaseException as e:
            if first is None:
                first = e
    if first is not None:
        raise first


class _NoOpContext:
    """What ``with`` gives when tiermem is disabled (``TIERMEM_DISABLE=1``)."""

    def __init__(self) -> None:
        self.stats = StepStats()

    def __enter__(self) -> "_NoOpContext":
        return self

    def __exit__(self, *exc) -> None:
        return None


class Offloader:
    """Decides, per saved activation of the wrapped forward pass, where it lives.

    ``Offloader(policy=..., **settings)``: every field of :class:`~tiermem.Config`
    is a keyword argument; arguments override ``TIERMEM_*`` variables, which
    override defaults. Enter it around each forward pass (``with off:``); it is
    cheap to enter and keeps its buffer pools across steps. ``stats`` is the last
    step's :class:`~tiermem.StepStats`. One Offloader is active in one thread at
    a time; use one per thread. ``close()`` frees its pools.

    ``hints`` (``policy="auto"`` only): a callable with a callable policy's
    signature whose answers the planner obeys (``CheckpointPolicy.MUST_*``) or
    weighs (``PREFER_*``, tier names); ``None`` from it is no opinion. It is
    asked only in profiled and safe-order steps, never while a step follows a
    plan, so its answer must depend on the tensor, not on the step; a changed
    answer takes effect when the step's shapes are profiled again.

    Raises :class:`ConfigError` for bad settings and :class:`TierMemError` at
    unpack when a saved tensor was modified in place (as autograd would).
    """

    def __init__(self, policy: Any = None, *, hints: Optional[Callable] = None,
                 **settings: Any) -> None:
        self.config = Config.from_env(policy=policy, **settings)
        cfg = self.config
        check_hints(hints, cfg)
        cfg.warn_unused_settings()   # NOTE [Settings a policy ignores] in config.py
        #: The planner's ``hints`` callable (``None``: none).
        self.hints = hints
        self.stats = StepStats()
        self._lock = threading.Lock()
        self._active_thread: Optional[int] = None
        self._ctx: Optional[OffloadContext] = None
        #: ``close()`` was called: entering again raises (every tier alike).
        self.closed = False
        self._pid = os.getpid()   # NOTE [Fork]
        self._attachments: list = []   # attach(): NOTE [Attaching] in attach.py
        if cfg.disable:
            return
        self._placement = Placement(cfg)
        #: NOTE [Tail hold] in runtime/tailhold.py: the sources of the last moves.
        self._tail = TailHold()
        self._roots = RootWalks()   # NOTE [Roots walked once] in runtime/roots.py
        self._order = BackwardOrder(self._tail)   # NOTE [Backward order] in runtime/schedule.py
        #: Who answers each step's orders (tiermem/deciders.py).
        self._decider = make_decider(cfg, self._placement, hints, self._order)
        self.cpu_budget_bytes = self._placement.cpu_budget_bytes
        # Steps whose saved tensors may still be unpacked (a handle, or the
        # context, holds each): see ``in_use``.
        self._steps: "weakref.WeakSet" = weakref.WeakSet()

    # -- context protocol ---------------------------------------------------
    def __enter__(self):
        if self.config.disable:
            ctx = _NoOpContext()
            self.stats = ctx.stats
            return ctx
        if self._pid != os.getpid():
            raise TierMemError(
                f"tiermem: this Offloader was made in process {self._pid}, before this "
                "process was forked from it; its threads, pools and files are that "
                "process's: make a new Offloader in this process")
        if self.closed:
            raise TierMemError(
                "tiermem: this Offloader was closed (its pools, files and threads are "
                "gone); make a new Offloader for further steps")
        if torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing():
            raise TierMemError(   # NOTE [CUDA graph capture] in runtime/hooks.py
                "tiermem: the current CUDA stream is capturing a CUDA graph: tiermem's copies, "
                "event polls and disk reads cannot be captured. Enter the Offloader outside "
                "the captured region (or run that region under tiermem.no_offload())")
        me = threading.get_ident()
        with self._lock:
            if self._active_thread is not None:
                where = "this thread" if self._active_thread == me else "another thread"
                raise TierMemError(
                    f"tiermem: this Offloader is already active in {where}; nest a "
                    "different Offloader (or no_offload()), and use one Offloader per thread")
            self._active_thread = me
        try:
            # Between steps: the pools may give back idle pinned buffers now
            # (NOTE [Trimming pinned buffers] in memory/hostpool.py).
            for store in self._placement.movers:
                store.trim_idle()
            ctx = OffloadContext(self)
            self.stats = ctx.stats
            self._ctx = ctx
            self._steps.add(ctx.step)
            return ctx.__enter__()
        except BaseException:
            # Whatever failed (a step that could not be set up: a planner
            # ConfigError, an exchange between ranks that raised), the
            # Offloader is not active: the next ``with`` may enter it.
            self._ctx = None
            self._active_thread = None
            raise

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self.config.disable:
            self._ctx.__exit__(exc_type, exc, tb)

    def _exit(self, ctx: OffloadContext, failed: bool) -> None:
        self._ctx = None
        try:
            if failed:
                # The forward pass is abandoned: finish copies now so that the
                # partial graph's handles free their buffers when it is dropped.
                self._placement.drain()   # (its tail released: Step.end_forward)
            else:
                self._placement.launch()
                self._placement.poll()
        finally:   # NOTE [Every exit step runs]
            with self._lock:
                self._active_thread = None

    def _active_here(self) -> bool:
        """Whether a forward pass is under this Offloader in this thread now."""
        return self._active_thread == threading.get_ident()

    # -- attaching (NOTE [Attaching] in attach.py) -----------------------------
    def attach(self, module: torch.nn.Module) -> Attachment:
        """Run every forward of ``module`` under this Offloader, for training
        loops you do not own: ``off.attach(trainer.model); trainer.train()``.

        Each forward is entered as ``with off:`` would be, and left when it
        returns or raises; forwards run with grad mode off, or inside backward,
        are left alone, and a module called inside a forward already under
        this Offloader (a nested attached module, re-entrant calls) runs in
        that forward's step. Returns the :class:`~tiermem.attach.Attachment`;
        ``with off.attach(model): ...`` detaches on the way out. Raises
        :class:`TierMemError` if ``module`` is already attached to this
        Offloader, or if this Offloader is closed."""
        return attach_module(self, module)

    def detach(self, module: Optional[torch.nn.Module] = None) -> None:
        """Undo :meth:`attach` for ``module`` (:class:`TierMemError` if it is
        not attached), or for every attached module (``None``; idempotent)."""
        detach_modules(self, module)

    def expect_backward(self, which) -> None:
        """Say whose backward comes next when it is not the oldest forward
        whose backward has not run (the default: GPipe, 1F1B, accumulation).
        ``which``: a context of this Offloader (``with off as ctx``) or an int
        among those forwards (0: the oldest, -1: the latest). Its restores start
        now, within its window, and the tail hold keeps only its moves, until
        its backward ends. Only timing follows: a wrong guess is still exact.
        :class:`ConfigError` for any other value."""
        if not self.config.disable:   # NOTE [Backward order] in runtime/schedule.py
            self._order.name_next(which, self)

    # -- inspection / lifetime ------------------------------------------------
    @property
    def plan(self):
        """``policy="auto"``: the :class:`~tiermem.planner.Plan` the next step
        follows (``str()`` a per-module table, ``.explain(i)``, ``.reasons``,
        ``.as_dict()``), with the last planned step's measurements written in.
        ``None`` before the first profiled step's backward has run (under
        torch.distributed, before the second step begins: the ranks agree on
        the plan's inputs then), and for other policies. Read it after a
        backward: it settles the planner (plans from a finished profile, checks
        the last step against its plan's predictions)."""
        if self.config.disable:
            return None
        return self._decider.settle()

    @property
    def host_bytes_in_use(self) -> int:
        """Host bytes held by saved tensors still alive (0 when their graphs are freed)."""
        return 0 if self.config.disable else self._placement.host_bytes_in_use

    @property
    def disk_bytes_in_use(self) -> int:
        """Bytes of the nvme tier's file held by saved tensors still alive."""
        return 0 if self.config.disable else self._placement.disk_bytes_in_use

    @property
    def in_use(self) -> bool:
        """Whether a step of this Offloader may still unpack saved tensors (its
        graph, or its context object, is alive): ``close()`` would then lose
        them. Conservative: a graph held only by a reference cycle counts until
        the collector frees it."""
        return not self.config.disable and len(self._steps) > 0

    def store_stats(self) -> dict:
        """What the moving tiers hold now, since the Offloader was made:
        ``{"cpu": {...}, "nvme": {...}}`` (nvme only with a directory) with, per
        tier, its pool's bytes in use, held (in use + pooled idle) and buffers
        ever allocated (``host_*`` for cpu, ``staging_*`` for nvme), and
        ``pinned_returns``: pinned buffers dropped from a full pool, each a
        device sync on CUDA;
        for nvme also ``disk_used_bytes`` and ``disk_file_bytes`` (the arena
        file's size). ``{}`` when disabled."""
        return {} if self.config.disable else self._placement.store_stats()

    def close(self) -> None:
        """Wait for moves in flight, free the pooled buffers (idle ones once
        their last copy is done) and hand torch's cached pinned blocks back to
        the OS (so that the next Offloader in this process starts from a clean
        pinned pool), and remove the NVMe directory. Call it after the last backward: tensors still saved on NVMe
        cannot be restored afterwards (their backward raises TierMemError)."""
        self.closed = True
        release(self)   # the module hooks (NOTE [Hooks held between steps] in tracking/modules.py)
        if self.config.disable:
            return
        self._roots.release()   # NOTE [Registration hooks held while used] in runtime/roots.py
        self._tail.release_all()
        self._placement.close()

    def __repr__(self) -> str:
        policy = self.config.policy if self.config.policy is not None else "default"
        return f"Offloader(policy={policy!r}, disabled={self.config.disable})"


# NOTE [Fork]
# After os.fork() (multiprocessing's default start method on Linux, DataLoader
# workers, some launchers) only the forking thread exists in the child. The
# process-wide worker threads (ThreadCopier's, the I/O engines') are therefore
# forgotten in the child by at-fork hooks (runtime/copier.py, io/__init__.py), so that
# a new Offloader made there starts its own; an Offloader made before the fork
# refuses to be entered in the child (its pools, files and threads are the
# parent's), and offload()'s cache starts empty there. A C++ engine object kept
# across the fork anyway is inert there (NOTE [Engine after fork], csrc/io_engine.h). A child that never uses
# tiermem is not affected: the hooks only drop references.

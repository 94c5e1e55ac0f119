"""The hook manager: :class:`Offloader`, :func:`offload`, :func:`no_offload`.

Data flows one way: pack -> policy -> tier.put -> handle; unpack -> handle ->
tier.get -> tensor; autograd dropping a handle -> buffers back to the pools.

# NOTE [Pack order of checks]
# The pack hook runs for every saved tensor, so its checks are ordered from
# cheapest to dearest and stop at the first that decides: non-strided tensors,
# parameters/buffers (before size, so that stats never count a parameter as an
# activation), small tensors, a fixed "keep" policy, unmovable tensors, then the
# dedup lookup, and only then the policy (a callable policy gets a TensorInfo;
# a named one needs none). Kept tensors are never deduplicated: keeping a
# tensor twice costs nothing.
#
# Inside backward (a checkpoint re-running its forward, or a user's backward
# within the context) tensors are kept: what backward regenerates is consumed
# at once and is never offloaded again.
#
# NOTE [Dedup]
# A tensor saved by several ops in one step is stored once. The key is
# (storage pointer, offset, sizes, strides, dtype, version); since a freed
# storage's address can be reused by a new tensor of the same shape, each entry
# also holds a weak reference to the storage and is only a hit while that
# storage is alive. When producer tracking is on (recompute), kept tensors are
# registered too: recipes share their handles (NOTE [What a recipe holds]).
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import weakref
from typing import Any, Optional

import psutil
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .blocks import _scope as _block_scope
from .blocks import blocks_need_producers, current_block_order
from .config import Config
from .errors import ConfigError, TierMemError
from .policy import Tier, TensorInfo, resolve_policy, tier_order
from .prefetch import Prefetcher
from .producers import ProducerMode, Ref, storage_key
from .telemetry import StepStats
from .tiers.host import HostStore
from .tiers.base import exact_copy
from .tiers.keep import Kept, KeepStore, check_version
from .tiers.recompute import RecomputeStore
from .tracker import ModuleStack, current_module

__all__ = ["Offloader", "OffloadContext", "offload", "no_offload", "default_cpu_budget_bytes"]

_log = logging.getLogger("tiermem")
_KEEP = Tier.KEEP.value
_in_backward = torch._C._current_graph_task_id   # -1 outside autograd's engine


_dedup_key = storage_key


def default_nvme_budget_bytes(path: str) -> int:
    """80% of the free space of ``path`` now: checkpoints and logs often share
    the disk, and ENOSPC is caught anyway (the arena then stops growing)."""
    return int(psutil.disk_usage(path).free * 0.8)


# Errors of making files in the NVMe dir that are about the dir (a ConfigError).
_BAD_DIR_ERRNOS = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOENT, errno.ENOTDIR,
                   errno.ENOSPC, errno.EDQUOT)


def _make_nvme_store(cfg: Config):
    from .io import get_engine
    from .spilldir import check_nvme_dir
    from .tiers.nvme import NvmeStore
    root = check_nvme_dir(cfg.nvme_dir)
    budget = (cfg.nvme_budget if cfg.nvme_budget is not None
              else default_nvme_budget_bytes(root))
    engine = get_engine(cfg.engine, cfg.io_threads)
    # Pinned staging for CUDA tensors' writes and reads in flight; when it is
    # full, further tensors go to the next tier rather than waiting.
    staging = max(cfg.prefetch_bytes or 0, 256 << 20)
    try:
        return NvmeStore(root, engine, budget, staging, cfg.verify, cfg.io_threads)
    except OSError as e:   # the private directory or the arena file could not be made
        if e.errno not in _BAD_DIR_ERRNOS:
            raise
        raise ConfigError(f"tiermem: TIERMEM_NVME_DIR={root!r}: cannot create tiermem's "
                          f"private directory or arena file there: {e}") from None


def default_cpu_budget_bytes() -> int:
    """Half the RAM available now, shared among the node's ranks.

    Half, because the rest of the process (data loading, optimizer state on the
    host, pinned staging of other libraries, page cache) needs room too and an
    out-of-memory kill loses the run; divided by ``LOCAL_WORLD_SIZE`` (set by
    torchrun) because every rank on the node starts its own Offloader.
    """
    try:
        ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        ranks = 1
    return psutil.virtual_memory().available // 2 // ranks


def _is_param(t: torch.Tensor, param_storages: set) -> bool:
    """Parameters, buffers and user leaves that require grad (never moved).

    nn.Linear saves ``weight.t()``, a *view* of a Parameter, so the base and the
    storage count, not the Python type of ``t``. ``issubclass`` on the type,
    because ``isinstance(t, Parameter)`` goes through a slow metaclass hook.
    """
    if _is_stable_param(t):
        return True
    return (bool(param_storages) and type(t) is torch.Tensor
            and t.untyped_storage().data_ptr() in param_storages)


def _is_stable_param(t: torch.Tensor) -> bool:
    """A parameter (frozen or not, or a view of one) or a leaf that requires
    grad: never modified during a forward pass."""
    base = t._base
    if base is None:
        base = t
    return (base.requires_grad and base.is_leaf) or issubclass(  # frozen parameters
        type(base), torch.nn.Parameter)


_opaque_hooks: dict = {}


def _unpack_hook():
    """The unpack hook of every context, hidden from torch.compile (made once)."""
    hook = _opaque_hooks.get("unpack")
    if hook is None:
        hook = _opaque_hooks["unpack"] = _opaque(OffloadContext._unpack)
    return hook


def _keep_pack(t: torch.Tensor) -> Kept:
    return Kept(t, "")


def _opaque(fn):
    """``fn`` hidden from torch.compile.

    # NOTE [Hooks under torch.compile]
    # Recent PyTorch traces the active saved-tensor hooks into a compiled
    # graph (AOTAutograd); ours are Python bookkeeping, not graph code, and
    # tracing them fails (measured: BackendCompilerFailed on `_is_param`). Hidden
    # from Dynamo they run eagerly when the compiled function saves its tensors,
    # as PyTorch did before (cost: ~0.4 µs per call in eager).
    """
    try:
        import torch._dynamo
        return torch._dynamo.disable(fn)
    except Exception:   # a torch without Dynamo: nothing to hide from
        return fn


def _movable(t: torch.Tensor) -> bool:
    return type(t) is torch.Tensor and t.device.type in ("cpu", "cuda")


class OffloadContext(torch.autograd.graph.saved_tensors_hooks):
    """One step of an :class:`Offloader`: the forward pass under ``with``, and the
    backward that consumes its saved tensors. ``stats`` holds what it did."""

    def __init__(self, offloader: "Offloader") -> None:
        self._off = offloader
        self.stats = StepStats()
        self.prefetcher = Prefetcher(offloader.config.prefetch_bytes,
                                     moved_bytes=self._moved_bytes)
        self._index = 0
        self._dedup: dict = {}
        self._recipe_inputs: dict = {}   # kept copies made for recipes only
        # Tiers after recompute in the order of the tensor whose recipe is being
        # planned: where its recipe's private inputs go (see store_input).
        self._input_order: Optional[tuple] = None
        self._param_storages: set = set()
        self._seen_roots: set = set()
        self._modules = ModuleStack(on_root=self._on_root)
        #: Producer of each tensor of the forward (None unless the policy may
        #: recompute or is a callable that may read ``TensorInfo.op``).
        track = offloader._track_ops or blocks_need_producers()
        self.producers: Optional[ProducerMode] = ProducerMode() if track else None
        super().__init__(_opaque(self._pack), _unpack_hook())

    def _moved_bytes(self) -> int:
        by = self.stats.bytes_by_tier
        return by[Tier.CPU.value] + by[Tier.NVME.value]

    # -- module tracking --------------------------------------------------
    def _on_root(self, module: torch.nn.Module) -> None:
        if id(module) in self._seen_roots:
            return
        self._seen_roots.add(id(module))
        for tensors in (module.parameters(), module.buffers()):
            for p in tensors:
                if p.layout == torch.strided:   # sparse ones have no storage
                    self._param_storages.add(p.untyped_storage().data_ptr())

    # -- hooks ------------------------------------------------------------
    def _pack(self, t: torch.Tensor) -> Any:
        if _in_backward() != -1:
            # Saved by backward itself (a checkpoint regenerating its region,
            # create_graph): consumed at once, kept, not part of the step's stats.
            return Kept(t, "")
        off = self._off
        stats = self.stats
        for poll in off._pollers:
            poll()
        nbytes = t.numel() * t.element_size()
        if t.layout != torch.strided:
            stats.unsupported_count += 1
            stats.record(_KEEP, nbytes)
            return Kept(t, "")
        if _is_param(t, self._param_storages):
            stats.param_count += 1
            return Kept(t, "")
        if nbytes < off._min_bytes or nbytes == 0:
            stats.small_count += 1
            stats.record(_KEEP, nbytes)
            return Kept(t, "")
        scoped = getattr(_block_scope, "stack", None)
        scoped = scoped[-1] if scoped else None   # inside a block wrapped with a policy
        fixed = off._fixed if scoped is None else scoped[0]
        if fixed is Tier.KEEP:
            stats.record(_KEEP, nbytes)
            return Kept(t, "")
        if not _movable(t):
            stats.unsupported_count += 1
            stats.record(_KEEP, nbytes)
            return Kept(t, current_module())
        key = _dedup_key(t)
        hit = self._dedup.get(key)
        if hit is not None:
            storage_ref, handle_ref = hit
            handle = handle_ref()
            if handle is not None and not storage_ref.expired():
                stats.dedup_hits += 1
                self.share(handle)
                return handle
        module = current_module()
        if scoped is not None:
            order = scoped
        else:
            order = off._order if fixed is not None else self._ask_policy(t, module, nbytes)
        handle = off._put(order, t, self, module, nbytes)
        if type(handle) is not Kept or self.producers is not None:
            self._dedup[key] = (StorageWeakRef(t.untyped_storage()), weakref.ref(handle))
        return handle

    def _ask_policy(self, t: torch.Tensor, module: str, nbytes: int) -> tuple:
        index = self._index
        self._index += 1
        op = None if self.producers is None else self.producers.op_name(t)
        info = TensorInfo(t.shape, t.dtype, t.device, nbytes, module, op, index, False)
        return self._off._order_of(self._off._policy_fn(info))

    # -- services for the recompute tier (NOTE [What a recipe holds]) --------
    def lookup(self, t: Any) -> Any:
        """The handle of ``t`` (a tensor or a :class:`~tiermem.producers.Ref`)
        if this step already saved its values, else ``None``."""
        if type(t) is Ref:
            # Same storage object (the weak refs pin its identity), same values:
            # the handle holds them even if the storage was freed since (moved).
            hit = self._dedup.get(t.key) or self._recipe_inputs.get(t.key)
            if hit is None or hit[0].cdata != t.storage.cdata:
                return None   # same address, another storage
            return hit[1]()
        else:
            hit = self._dedup.get(_dedup_key(t))
            if hit is None:
                return None
        storage_ref, handle_ref = hit
        handle = handle_ref()
        return None if handle is None or storage_ref.expired() else handle

    @staticmethod
    def share(handle: Any) -> None:
        """Count one more consumer of ``handle`` in each backward pass."""
        if type(handle) is not Kept:
            handle.uses += 1

    #: A recipe may hold these as they are (NOTE [What a recipe holds]).
    is_stable_param = staticmethod(_is_stable_param)

    def is_small(self, t: torch.Tensor) -> bool:
        return t.numel() * t.element_size() < self._off._min_bytes

    @staticmethod
    def keep_handle(t: torch.Tensor, *, clone: bool) -> Kept:
        return Kept(exact_copy(t) if clone else t, "")

    def store_input(self, t: torch.Tensor) -> Any:
        """Store an input of a recipe that no one saved, registered for dedup:
        in the tiers the saved tensor being planned would go to if it were not
        recomputed (its policy's later choices). A callable policy is not asked
        again: it sees the tensors autograd saves, and ``TensorInfo.index``
        counts those only."""
        nbytes = t.numel() * t.element_size()
        module = current_module()
        order = self._input_order
        if order is None:   # not while planning (not expected): the tier order in force
            order = current_block_order() or self._off._order or (Tier.KEEP,)
        order = tuple(tier for tier in order if tier is not Tier.RECOMPUTE) or (Tier.KEEP,)
        # Autograd did not save ``t``, so the program may still modify it in
        # place (also while a copy of it is in flight); the recipe needs its
        # values of now: a private copy is stored, shared by recipes only (a
        # later save of ``t`` by autograd gets its own handle, with the in-place
        # check). NOTE [What a recipe holds].
        handle = self._off._put(order, exact_copy(t), self, module, nbytes)
        self._recipe_inputs[_dedup_key(t)] = (StorageWeakRef(t.untyped_storage()),
                                              weakref.ref(handle))
        return handle

    @staticmethod
    def _unpack(handle: Any) -> torch.Tensor:
        if type(handle) is Kept:
            check_version(handle.tensor, handle.version, handle.module)
            return handle.tensor
        return handle.store.get(handle)

    # -- context ----------------------------------------------------------
    def __enter__(self) -> "OffloadContext":
        self._modules.__enter__()
        try:
            super().__enter__()
            try:
                if self.producers is not None:
                    self.producers.__enter__()
            except BaseException:
                super().__exit__(None, None, None)
                raise
        except BaseException:
            self._modules.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if self.producers is not None:
                try:
                    self.producers.__exit__(exc_type, exc, tb)
                finally:
                    self.producers.clear()
                    self.producers = None
        finally:
            self._exit_hooks(exc_type, exc, tb)

    def _exit_hooks(self, exc_type, exc, tb) -> None:
        try:
            super().__exit__(exc_type, exc, tb)
        finally:
            self._modules.__exit__(exc_type, exc, tb)
            self._dedup.clear()
            self._recipe_inputs.clear()
            self._param_storages.clear()
            self._seen_roots.clear()
            self._off._exit(self, failed=exc_type is not None)


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

    Raises :class:`ConfigError` for bad settings and :class:`TierMemError` at
    unpack when a saved tensor was modified in place (as autograd would).
    """

    def __init__(self, policy: Any = None, **settings: Any) -> None:
        self.config = Config.from_env(policy=policy, **settings)
        cfg = self.config
        self.stats = StepStats()
        self._lock = threading.Lock()
        self._active_thread: Optional[int] = None
        self._warned: set = set()
        self._ctx: Optional[OffloadContext] = None
        if cfg.disable:
            return
        self._order, self._policy_fn = resolve_policy(cfg.policy, nvme_dir=cfg.nvme_dir)
        self._fixed = self._order[0] if self._order is not None else None
        self._orders: dict = {}
        # Producer tracking costs a Python call per op of the forward: only
        # when a recipe may be needed or a callable policy may read info.op.
        self._track_ops = (Tier.RECOMPUTE in self._order if self._order is not None
                           else not getattr(self._policy_fn, "tiermem_builtin", False))
        self._min_bytes = cfg.min_offload_bytes
        budget = cfg.cpu_budget if cfg.cpu_budget is not None else default_cpu_budget_bytes()
        self.cpu_budget_bytes = budget
        self._stores = {Tier.KEEP: KeepStore(), Tier.CPU: HostStore(budget),
                        Tier.RECOMPUTE: RecomputeStore()}
        wants_nvme = self._order is not None and Tier.NVME in self._order
        if wants_nvme and not cfg.nvme_dir:
            raise ConfigError(
                f"tiermem: policy={cfg.policy!r} uses the nvme tier, which needs a directory: "
                "set TIERMEM_NVME_DIR or pass nvme_dir")
        if cfg.nvme_dir and (self._order is None or wants_nvme):
            self._stores[Tier.NVME] = _make_nvme_store(cfg)
        self._movers = [s for s in self._stores.values()
                        if s.tier not in (Tier.KEEP, Tier.RECOMPUTE)]
        self._pollers = [s.poll for s in self._movers]

    # -- context protocol ---------------------------------------------------
    def __enter__(self):
        if self.config.disable:
            ctx = _NoOpContext()
            self.stats = ctx.stats
            return ctx
        me = threading.get_ident()
        with self._lock:
            if self._active_thread is not None:
                where = "this thread" if self._active_thread == me else "another thread"
                raise TierMemError(
                    f"tiermem: this Offloader is already active in {where}; nest a "
                    "different Offloader (or no_offload()), and use one Offloader per thread")
            self._active_thread = me
        ctx = OffloadContext(self)
        self.stats = ctx.stats
        self._ctx = ctx
        try:
            return ctx.__enter__()
        except BaseException:
            self._active_thread = None
            raise

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self.config.disable:
            self._ctx.__exit__(exc_type, exc, tb)

    def _exit(self, ctx: OffloadContext, failed: bool) -> None:
        self._ctx = None
        if failed:
            # The forward pass is abandoned: finish copies now so that the
            # partial graph's handles free their buffers when it is dropped.
            for store in self._movers:
                store.drain()
        else:
            self._poll()
        with self._lock:
            self._active_thread = None

    # -- internals used by OffloadContext ------------------------------------
    def _poll(self) -> None:
        for store in self._movers:
            store.poll()

    def _order_of(self, choice: Any) -> tuple:
        """The tier order for a callable policy's answer (cached per answer)."""
        key = tuple(choice) if isinstance(choice, list) else choice
        try:
            order = self._orders.get(key)
        except TypeError:   # unhashable answer: checked (and rejected) below
            order = None
        if order is None:
            order = tier_order(choice, source="the policy")
            if order[0] not in self._stores:
                raise TierMemError(
                    f"tiermem: the policy chose tier {order[0].value!r}, which is not "
                    f"available here (nvme needs nvme_dir / TIERMEM_NVME_DIR); available: "
                    f"{', '.join(t.value for t in self._stores)}")
            self._orders[key] = order
        return order

    def _put(self, order: tuple, t: torch.Tensor, ctx: OffloadContext, module: str,
             nbytes: int):
        stats = ctx.stats
        for i, candidate in enumerate(order):
            store = self._stores.get(candidate)
            if store is None:
                continue
            if candidate is Tier.RECOMPUTE:
                ctx._input_order = order[i + 1:]
                try:
                    handle = store.put(t, ctx, module)
                finally:
                    ctx._input_order = None
            else:
                handle = store.put(t, ctx, module)   # keep never refuses
            if handle is None:
                if candidate is not Tier.RECOMPUTE:   # counted by reason in the store
                    stats.budget_fallbacks += 1
                    if not getattr(store, "explained_refusals", False):
                        self._warn_full(candidate)
                continue
            stats.record(candidate.value, nbytes)
            return handle
        raise TierMemError("tiermem: no tier accepted a tensor; this is a bug")

    def _warn_full(self, tier: Tier) -> None:
        if tier in self._warned:
            return
        self._warned.add(tier)
        if tier is Tier.CPU:
            _log.warning(
                "tiermem: the cpu tier is full (budget %d bytes, TIERMEM_CPU_BUDGET); "
                "further tensors stay on their device. Counted in stats.budget_fallbacks; "
                "this warning is shown once.", self.cpu_budget_bytes)
        else:
            _log.warning("tiermem: the %s tier is full; tensors go to the next tier "
                         "(shown once).", tier.value)

    # -- inspection / lifetime ------------------------------------------------
    @property
    def host_bytes_in_use(self) -> int:
        """Host bytes held by saved tensors still alive (0 when their graphs are freed)."""
        if self.config.disable:
            return 0
        return self._stores[Tier.CPU].in_use_bytes

    @property
    def disk_bytes_in_use(self) -> int:
        """Bytes of the nvme tier's file held by saved tensors still alive."""
        store = None if self.config.disable else self._stores.get(Tier.NVME)
        return 0 if store is None else store.used_bytes

    def close(self) -> None:
        """Wait for moves in flight, free the pooled buffers and remove the NVMe
        directory. Call it after the last backward: tensors still saved on NVMe
        cannot be restored afterwards (their backward raises TierMemError)."""
        if self.config.disable:
            return
        for store in self._movers:
            store.close()

    def __repr__(self) -> str:
        policy = self.config.policy if self.config.policy is not None else "default"
        return f"Offloader(policy={policy!r}, disabled={self.config.disable})"


_tls = threading.local()
_CACHE_SIZE = 8


def offload(policy: Any = None, **settings: Any) -> Offloader:
    """One-shot form: ``with tiermem.offload(policy="cpu"): loss = model(x)``.

    Returns an Offloader cached per thread and per resulting :class:`Config`, so
    repeated calls with the same settings reuse the same pools.
    """
    cfg = Config.from_env(policy=policy, **settings)
    cache = getattr(_tls, "cache", None)
    if cache is None:
        cache = _tls.cache = {}
    off = cache.get(cfg)
    if off is None:
        if len(cache) >= _CACHE_SIZE:
            oldest = next(iter(cache))
            cache.pop(oldest).close()
        off = cache[cfg] = Offloader(**{f: getattr(cfg, f) for f in cfg.__dataclass_fields__})
    return off


class no_offload(torch.autograd.graph.saved_tensors_hooks):
    """A region whose saved tensors stay where autograd puts them.

    Nested inside an Offloader it wins (the innermost hooks apply). Tensors are
    kept as plain autograd would keep them, with autograd's in-place check
    preserved (see NOTE [In-place check]).
    """

    def __init__(self) -> None:
        pack = _opaque_hooks.get("keep")
        if pack is None:
            pack = _opaque_hooks["keep"] = _opaque(_keep_pack)
        super().__init__(pack, _unpack_hook())

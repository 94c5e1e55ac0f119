"""Placement: which store takes a saved tensor, within the budgets.

:class:`Placement` owns the stores of one Offloader (keep, cpu, recompute, and
nvme when a directory is set), the policy (a fixed tier order for named
policies, a callable asked per tensor otherwise) and the fallback loop: a
tensor goes to the first tier of its order that takes it; a full tier passes
it to the next, with one warning per tier. Under ``policy="auto"`` the
step's decider (tiermem/deciders.py) answers "which tiers, in which order"
and passes the order in; placement never asks it.

It is called by the pack hook (:mod:`tiermem.runtime.hooks`) and, for a recipe's
inputs, by the step's recipe services (:meth:`tiermem.runtime.step.Step.store_input`)
with the tier order passed explicitly. It never reads the hook's state.
"""

from __future__ import annotations

import errno
import logging
from typing import Any, Dict, Optional, Tuple

import torch

from ..config import Config
from ..errors import ConfigError, TierMemError
from ..memory.cgroup import available_memory_bytes
from ..memory.ranks import STAGING_MIN_BYTES, STAGING_NODE_BYTES, per_rank_share
from ..memory.spilldir import default_nvme_budget_bytes
from ..policy import AUTO, FALLBACK, Tier, TensorInfo, TierOrder, resolve_policy, tier_order
from ..tiers.base import TierStore
from ..tiers.host import HostStore
from ..tiers.keep import KeepStore
from ..tiers.recompute import RecomputeStore

__all__ = ["Placement", "default_cpu_budget_bytes", "default_nvme_budget_bytes",
           "default_staging_bytes"]

_log = logging.getLogger("tiermem")


def default_cpu_budget_bytes() -> int:
    """Half the RAM available now, shared among the node's ranks.

    Available: what the OS reports (``psutil``), or, in a memory cgroup with a
    limit (a container), what the cgroup may still take if that is less
    (:func:`~tiermem.memory.cgroup.available_memory_bytes`; NOTE [Container memory
    limits] in memory/cgroup.py).
    Half, because the rest of the process (data loading, optimizer state on the
    host, pinned staging of other libraries, page cache) needs room too and an
    out-of-memory kill loses the run; divided by ``LOCAL_WORLD_SIZE`` (set by
    torchrun) because every rank on the node starts its own Offloader (NOTE
    [Per-rank budgets] in memory/ranks.py).
    """
    return per_rank_share(available_memory_bytes() // 2)


def default_staging_bytes(prefetch_bytes: Optional[int]) -> int:
    """Pinned staging of the nvme tier (writes and reads in flight) for this
    rank: the node's :data:`~tiermem.memory.ranks.STAGING_NODE_BYTES` divided among its
    ranks, at least :data:`~tiermem.memory.ranks.STAGING_MIN_BYTES`, or
    ``prefetch_bytes`` if that is larger (NOTE [Per-rank budgets])."""
    share = max(per_rank_share(STAGING_NODE_BYTES), STAGING_MIN_BYTES)
    return max(prefetch_bytes or 0, share)


# Errors of making files in the NVMe dir that are about the dir (a ConfigError).
_BAD_DIR_ERRNOS = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOENT, errno.ENOTDIR,
                   errno.ENOSPC, errno.EDQUOT)


def _make_nvme_store(cfg: Config) -> TierStore:
    from ..io import acquire_engine, release_engine
    from ..memory.spilldir import check_nvme_dir
    from ..tiers.nvme import NvmeStore
    setting = cfg.setting_name("nvme_dir")   # NOTE [Setting names in messages] in config.py
    root = check_nvme_dir(cfg.nvme_dir, setting)
    engine = acquire_engine(cfg.engine, cfg.io_threads)   # released by the store's close
    # Pinned staging for CUDA tensors' writes and reads in flight; when it is
    # full, further tensors go to the next tier rather than waiting.
    staging = default_staging_bytes(cfg.prefetch_bytes)
    try:
        # Budget None: the default, measured by the store once stale
        # directories are gone.
        return NvmeStore(root, engine, cfg.nvme_budget, staging, cfg.verify, cfg.io_threads)
    except BaseException as e:
        release_engine(engine)
        if not isinstance(e, OSError) or e.errno not in _BAD_DIR_ERRNOS:
            raise
        raise ConfigError(f"tiermem: {setting}={root!r}: cannot create tiermem's "
                          f"private directory or arena file there: {e}") from None


class Placement:
    """The stores of one Offloader and the choice among them.

    ``fixed_order``: the tier order of a named policy (``None`` for a callable
    one, then asked through :meth:`order_for`). ``put`` tries the tiers of an
    order in turn and returns the first handle; keep ends every order and never
    refuses.
    """

    def __init__(self, cfg: Config) -> None:
        self.fixed_order, self.policy_fn = resolve_policy(cfg.policy, nvme_dir=cfg.nvme_dir)
        auto = self.policy_fn is AUTO
        if auto:   # the step's decider answers (its StepDecider), never a policy function
            self.policy_fn = None
        #: The first tier of a named policy (``None`` for a callable policy).
        self.fixed: Optional[Tier] = (self.fixed_order[0] if self.fixed_order is not None
                                      else None)
        self._orders: dict = {}
        self._completed: dict = {}
        # Producer tracking costs a Python call per op of the forward: only
        # when a recipe may be needed or a callable policy may read info.op.
        # Under auto the step's decider says (StepDecider.tracking).
        self.tracks_producers = (
            Tier.RECOMPUTE in self.fixed_order if self.fixed_order is not None
            else not auto and not getattr(self.policy_fn, "tiermem_builtin", False))
        self.cpu_budget_bytes = (cfg.cpu_budget if cfg.cpu_budget is not None
                                 else default_cpu_budget_bytes())
        # keep, cpu and recompute always (a block wrapped with its own policy
        # may ask for them); nvme only where a directory is set and wanted.
        self.stores: Dict[Tier, TierStore] = {
            Tier.KEEP: KeepStore(), Tier.CPU: HostStore(self.cpu_budget_bytes),
            Tier.RECOMPUTE: RecomputeStore()}
        wants_nvme = self.fixed_order is not None and Tier.NVME in self.fixed_order
        if wants_nvme and not cfg.nvme_dir:
            raise ConfigError(
                f"tiermem: policy={cfg.policy!r} uses the nvme tier, which needs a directory: "
                "set TIERMEM_NVME_DIR or pass nvme_dir")
        if cfg.nvme_dir and (self.fixed_order is None or wants_nvme):
            self.stores[Tier.NVME] = _make_nvme_store(cfg)
        #: The stores that move tensors away (their copies land asynchronously).
        self.movers = tuple(s for s in self.stores.values()
                            if s.tier not in (Tier.KEEP, Tier.RECOMPUTE))
        self._warned: set = set()

    # -- choosing -----------------------------------------------------------------
    def order_for(self, info: TensorInfo) -> Tuple[Tier, ...]:
        """The tier order a callable policy gives for ``info`` (cached per
        answer): a :class:`~tiermem.policy.TierOrder`, whose ``must`` and
        ``hint`` say whether it came from a ``CheckpointPolicy`` constraint or
        hint (NOTE [CheckpointPolicy answers] in policy.py)."""
        choice: Any = self.policy_fn(info)
        key = tuple(choice) if isinstance(choice, list) else choice
        try:
            order = self._orders.get(key)
        except TypeError:   # unhashable answer: checked (and rejected) below
            order = None
        if order is None:
            order = tier_order(choice, source="the policy")
            if order[0] not in self.stores:
                raise TierMemError(
                    f"tiermem: the policy chose tier {order[0].value!r}, which is not "
                    f"available here (nvme needs nvme_dir / TIERMEM_NVME_DIR); available: "
                    f"{', '.join(t.value for t in self.stores)}")
            self._orders[key] = order
        if order.then_default:
            order = self.complete(order, info.device)
        return order

    def complete(self, order: TierOrder, device: torch.device) -> TierOrder:
        """``order`` followed by the default tier of ``device`` and its
        fallbacks, when ``order.then_default`` asks for them (rule 1 of NOTE
        [CheckpointPolicy answers] in policy.py: cpu for CUDA tensors; nvme for
        CPU tensors when this Offloader has an nvme tier, else keep). Cached."""
        if not order.then_default:
            return order
        key = (tuple(order), order.must, order.hint, device.type)
        done = self._completed.get(key)
        if done is None:
            if device.type == "cuda":
                default = Tier.CPU
            else:
                default = Tier.NVME if Tier.NVME in self.stores else Tier.KEEP
            tiers = list(order)
            for t in [default] + [Tier(f) for f in FALLBACK[default.value]] + [Tier.KEEP]:
                if t not in tiers:
                    tiers.append(t)
            done = self._completed[key] = order.with_tiers(tiers)
        return done

    def put(self, order: Tuple[Tier, ...], t: torch.Tensor, step, module: str,
            nbytes: int):
        """The handle of the first tier of ``order`` that takes ``t``; counted
        in ``step.stats`` under that tier. A tier that refuses (full, or for
        recompute not eligible) passes ``t`` on to the next."""
        stats = step.stats
        for i, candidate in enumerate(order):
            store = self.stores.get(candidate)
            if store is None:
                continue
            if candidate is Tier.RECOMPUTE:
                # A recipe's inputs go where ``t`` would go if not recomputed.
                # MUST_RECOMPUTE first: the store raises rather than refuse
                # (NOTE [CheckpointPolicy answers] in policy.py).
                must = i == 0 and getattr(order, "must", False)
                handle = store.put(t, step, module, order[i + 1:], must=must)
            else:
                handle = store.put(t, step, module)   # keep never refuses
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

    # -- moves in flight ----------------------------------------------------------
    def launch(self) -> None:
        """Launch every reserved move: the forward is over (NOTE [Launch after
        the saving op] in tiers/moving.py)."""
        for store in self.movers:
            store.launch()

    def poll(self) -> None:
        """Finish the moves that have landed (forward thread; NOTE [Copy landed])."""
        for store in self.movers:
            store.poll()

    def drain(self) -> None:
        """Wait for every move in flight (an abandoned forward pass)."""
        for store in self.movers:
            store.drain()

    def close(self) -> None:
        """Wait for moves in flight and free every store's buffers and files."""
        for store in self.movers:
            store.close()

    def store_stats(self) -> dict:
        """Per moving tier, what its store holds now (see Offloader.store_stats)."""
        out = {}
        for store in self.movers:
            pools = {"host": store.pool} if store.tier is Tier.CPU else {"staging": store.staging}
            entry = {}
            for name, pool in pools.items():
                entry[f"{name}_in_use_bytes"] = pool.in_use_bytes
                entry[f"{name}_held_bytes"] = pool.held_bytes
                entry[f"{name}_allocations"] = pool.allocations
            entry["pinned_returns"] = sum(p.pinned_returns for p in pools.values())
            if store.tier is Tier.NVME:
                entry["disk_used_bytes"] = store.used_bytes
                entry["disk_file_bytes"] = store.arena.size_bytes
            out[store.tier.value] = entry
        return out

    @property
    def host_bytes_in_use(self) -> int:
        store = self.stores.get(Tier.CPU)
        return 0 if store is None else store.in_use_bytes

    @property
    def disk_bytes_in_use(self) -> int:
        store = self.stores.get(Tier.NVME)
        return 0 if store is None else store.used_bytes

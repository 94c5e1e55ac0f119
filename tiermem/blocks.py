"""``wrap_blocks``: checkpointing and a tier policy per block, in one call.

The recipe that gives most memory for least time on large models is
"checkpoint each block, offload the block inputs": inside a block nothing is
saved (it is recomputed in backward), and the one tensor per block that
checkpointing must keep goes through tiermem's policy (to CPU RAM or NVMe).
``wrap_blocks`` applies it without editing the model::

    blocks = tiermem.wrap_blocks(model, TransformerBlock, checkpoint=True)
    off = tiermem.Offloader(policy="cpu")
    with off:
        loss = model(batch)
    loss.backward()
    blocks.unwrap()          # back to the plain model (optional)

# NOTE [How blocks are wrapped]
# Each matched module gets an instance attribute ``forward`` (a picklable
# :class:`_BlockForward` holding the module), which ``nn.Module.__call__``
# prefers to the class's method; hooks, ``state_dict`` keys and parameter
# names are unchanged, ``deepcopy`` gives a copy wrapped the same way, and
# ``unwrap`` deletes the attribute. The class's own ``forward`` is what runs
# inside the checkpoint.
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Any, Callable, List, Optional, Sequence, Tuple, Type, Union

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy
from torch.utils.checkpoint import checkpoint as _checkpoint
from torch.utils.checkpoint import create_selective_checkpoint_contexts

from .config import Config
from .errors import ConfigError, TierMemError
from .policy import Tier, resolve_policy, tier_order
from .tracking.modules import current_module
from .tracking.modules import track_block, untrack_block

__all__ = ["wrap_blocks", "BlockWrapping", "BlockScope", "BLOCK_SCOPE", "SELECTIVE_SAVE_OPS"]

_aten = torch.ops.aten

#: Ops whose outputs selective checkpointing (``checkpoint="selective"``) saves;
#: everything else in the block is recomputed. Matmuls and attention: the
#: expensive ops (Korthikanti et al.'s selective recompute).
SELECTIVE_SAVE_OPS = frozenset(
    getattr(_aten, n) for n in ("mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention",
                                "_scaled_dot_product_efficient_attention",
                                "_scaled_dot_product_cudnn_attention",
                                "_scaled_dot_product_flash_attention_for_cpu", "convolution")
    if hasattr(_aten, n))

_CHECKPOINT_MODES = (False, True, "full", "selective", "auto")

_in_backward = torch._C._current_graph_task_id   # -1 outside autograd's engine


class BlockScope(threading.local):
    """The ``wrap_blocks`` scope, per thread (a decider per block:
    tiermem/deciders.py): ``stack``, the tier orders of the wrapped blocks
    running, innermost last, which the pack hook takes before the step's
    decider; ``contexts``, the tiermem contexts entered (``OffloadContext``,
    innermost last), whose ``planning`` (the step's ``StepDecider``) a
    ``checkpoint="auto"`` block asks.
    The Offloader hands it to each step's pack hook. (Attributes set in
    ``__init__``, which runs once per thread: reading them costs no failed
    lookup, and the pack hook reads ``stack`` for every tensor.)"""

    def __init__(self) -> None:
        self.stack: list = []
        self.contexts: list = []
        #: Blocks entered on this thread whose policy is a MUST answer other
        #: than MUST_RECOMPUTE, and the last one's policy name (_PlainRun).
        self.must_entered = 0
        self.must_name: Optional[str] = None


#: The one :class:`BlockScope` (its attributes are per thread).
BLOCK_SCOPE = BlockScope()

#: Wrapped blocks whose policy may recompute: while any exists, Offloaders
#: track producers while such a block runs (NOTE [Scoped tracking] in
#: tracking/modules.py) even if their own policy would not need it.
_recomputing_blocks: "weakref.WeakSet[_BlockForward]" = weakref.WeakSet()


#: Those among them whose policy is ``MUST_RECOMPUTE``: while any exists,
#: Offloaders track the whole forward, so that whether such a block's tensor
#: can be recomputed (else ``TierMemError``) does not depend on where its
#: producer ran (NOTE [Scoped tracking] in tracking/modules.py).
_must_recompute_blocks: "weakref.WeakSet[_BlockForward]" = weakref.WeakSet()


#: Every live wrapped block with a policy of its own (a tier order): while
#: any exists, a step cannot know it keeps every tensor (NOTE [Steps that
#: keep everything] in offloader.py).
_policy_blocks: "weakref.WeakSet[_BlockForward]" = weakref.WeakSet()


def blocks_with_policy() -> bool:
    """Whether a live wrapped block has a policy (a tier order) of its own."""
    return len(_policy_blocks) > 0


def blocks_need_producers() -> bool:
    """Whether a live wrapped block has a policy that may recompute."""
    return len(_recomputing_blocks) > 0


def blocks_need_full_tracking() -> bool:
    """Whether a live wrapped block's policy is ``MUST_RECOMPUTE``."""
    return len(_must_recompute_blocks) > 0


def _selective_policy(ctx, op, *args, **kwargs):
    if op in SELECTIVE_SAVE_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


class _BlockForward:
    """The ``forward`` of a wrapped block. See NOTE [How blocks are wrapped]."""

    def __init__(self, module: nn.Module, mode: Optional[str], use_reentrant: bool,
                 order: Optional[Tuple[Tier, ...]]) -> None:
        self.module = module
        self.mode = mode
        self.use_reentrant = use_reentrant
        self.order = order
        self._register()

    def _register(self) -> None:
        if self.order is not None:
            _policy_blocks.add(self)
        if self.order is not None and Tier.RECOMPUTE in self.order:
            _recomputing_blocks.add(self)
            if getattr(self.order, "must", False) and self.order[0] is Tier.RECOMPUTE:
                _must_recompute_blocks.add(self)

    def __setstate__(self, state: dict) -> None:   # copies made by deepcopy / pickle
        self.__dict__.update(state)
        self._register()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        fn = functools.partial(type(self.module).forward, self.module)
        stack = None
        tracked = ()
        if self.order is not None:
            stack = BLOCK_SCOPE.stack
            stack.append(self.order)
            if getattr(self.order, "must", False) and self.order[0] is not Tier.RECOMPUTE:
                BLOCK_SCOPE.must_entered += 1
                hint = self.order.hint
                BLOCK_SCOPE.must_name = hint.name if hint is not None else "a MUST policy"
            if Tier.RECOMPUTE in self.order:   # NOTE [Scoped tracking] in tracking/modules.py
                tracked = track_block()
        try:
            if self.mode is None or not torch.is_grad_enabled():
                return fn(*args, **kwargs)
            if self.mode == "auto":
                return self._auto(fn, args, kwargs)
            if self.mode == "selective":
                return _checkpoint(fn, *args, use_reentrant=False, **kwargs,
                                  context_fn=functools.partial(
                                      create_selective_checkpoint_contexts, _selective_policy))
            return self._full(fn, args, kwargs)
        finally:
            if stack is not None:
                stack.pop()
                if tracked:
                    untrack_block(tracked)

    def _full(self, fn, args, kwargs) -> Any:
        if self.use_reentrant and kwargs:
            raise TypeError(
                "tiermem.wrap_blocks: reentrant checkpointing does not take keyword "
                f"arguments ({', '.join(kwargs)}); use use_reentrant=False")
        return _checkpoint(fn, *args, use_reentrant=self.use_reentrant, **kwargs)

    def _auto(self, fn, args, kwargs) -> Any:
        """``checkpoint="auto"``: the innermost tiermem context's planner
        decides (NOTE [Blocks the planner may checkpoint] in
        planner/runtime.py); with none, or outside an auto Offloader, or in
        backward (a checkpoint regenerating an enclosing region), the block
        runs plainly."""
        contexts = BLOCK_SCOPE.contexts
        ctx = contexts[-1] if contexts else None
        planning = None if ctx is None else ctx.planning   # its StepDecider
        if planning is None or _in_backward() != -1:
            return fn(*args, **kwargs)
        step = ctx.step
        out, resume_at = planning.block(current_module(), args, _PlainRun(fn, args, kwargs),
                                        lambda: self._full(fn, args, kwargs), step)
        if resume_at is not None:   # after a planned checkpoint: numbered as profiled
            step.index = resume_at
        return out


class _PlainRun:
    """An auto block's plain run; afterwards ``must_inside`` names the MUST
    policy of a block nested in it (a block wrapped with
    ``policy=CheckpointPolicy.MUST_SAVE``, say), or is None: the planner
    never checkpoints such a block (it would run that forward again)."""

    __slots__ = ("fn", "args", "kwargs", "must_inside")

    def __init__(self, fn, args, kwargs) -> None:
        self.fn, self.args, self.kwargs, self.must_inside = fn, args, kwargs, None

    def __call__(self) -> Any:
        before = BLOCK_SCOPE.must_entered
        out = self.fn(*self.args, **self.kwargs)
        if BLOCK_SCOPE.must_entered != before:
            self.must_inside = BLOCK_SCOPE.must_name
        return out


class BlockWrapping:
    """What :func:`wrap_blocks` did: ``names`` of the wrapped blocks (qualified,
    as in ``model.named_modules()``); :meth:`unwrap` undoes it."""

    def __init__(self, modules: List[Tuple[str, nn.Module]]) -> None:
        self._modules = modules
        self.names = [n for n, _ in modules]

    def unwrap(self) -> None:
        """Give every wrapped block its own ``forward`` back (idempotent)."""
        for _, m in self._modules:
            fwd = m.__dict__.get("forward")
            if isinstance(fwd, _BlockForward):
                _policy_blocks.discard(fwd)
                _recomputing_blocks.discard(fwd)
                _must_recompute_blocks.discard(fwd)
                del m.forward
        self._modules = []

    def __len__(self) -> int:
        return len(self.names)

    def __repr__(self) -> str:
        return f"BlockWrapping({len(self.names)} blocks: {', '.join(self.names[:3])}" + (
            ", ...)" if len(self.names) > 3 else ")")


Selector = Union[Type[nn.Module], Tuple[Type[nn.Module], ...], Callable[[str, nn.Module], bool],
                 Sequence[str]]


def wrap_blocks(model: nn.Module, blocks: Selector, *, checkpoint: Union[bool, str] = True,
                use_reentrant: bool = False,
                policy: Union[str, CheckpointPolicy, Sequence, None] = None) -> BlockWrapping:
    """Checkpoint the blocks of ``model`` and/or give their saved tensors a policy.

    - ``blocks``: a module class (or tuple of classes), a predicate
      ``(qualified_name, module) -> bool``, or a list of qualified names.
      Blocks nested inside a matched block are not wrapped again.
    - ``checkpoint``: ``True``/``"full"`` runs each block under
      ``torch.utils.checkpoint.checkpoint`` (non-reentrant by default): only the
      block's inputs are saved, and they go through the active Offloader's
      policy. ``"selective"``: selective checkpointing that saves the outputs of
      :data:`SELECTIVE_SAVE_OPS` and recomputes the rest (those saved outputs
      are held by PyTorch's checkpoint, not by tiermem: they stay on the
      device). ``False``: no checkpointing. ``"auto"``: inside an
      ``Offloader(policy="auto")`` the planner chooses per block, from the
      profiled step, between checkpointing the whole block and per-tensor
      tiers inside it (each block's choice and reason in ``off.plan``);
      anywhere else (no Offloader, a fixed or callable policy, or a budget
      that fits) the block runs plainly, as unwrapped: without a budget
      there is nothing that checkpointing's extra forward would buy. Takes no
      ``policy`` (the planner places the block's tensors).
    - ``policy``: a tier name or preference list (``"cpu"``, ``"recompute,cpu"``)
      for the tensors saved while a block runs, overriding the Offloader's own
      policy there (the rest of the model keeps the Offloader's policy).
      ``torch.utils.checkpoint.CheckpointPolicy`` values are taken too, alone
      or in such a list (``CheckpointPolicy.PREFER_RECOMPUTE``,
      ``[CheckpointPolicy.MUST_RECOMPUTE, "nvme"]``), with the meaning they
      have as a callable policy's answers: MUST_RECOMPUTE raises
      ``TierMemError`` in the forward for a tensor of the block that cannot be
      recomputed.
      With ``recompute`` in it, an Offloader tracks producers while such a
      block runs (only then, unless its own policy needs tracking): a tensor the block saves whose
      producer ran before the block (its inputs) has no recipe and goes to
      the next tier of the block's policy. With ``MUST_RECOMPUTE``, every
      Offloader tracks the whole forward while such a block exists (whether
      a tensor can be recomputed must not depend on where its producer ran).

    Returns a :class:`BlockWrapping`; raises ``ConfigError`` when nothing
    matches or a setting is invalid, and when a block is already wrapped.
    Outside ``torch.enable_grad()`` (inference) blocks run plainly.
    """
    # Only the bools and the names: 0 and 1 compare equal to False and True,
    # and 0 would otherwise have meant full checkpointing.
    if not (isinstance(checkpoint, bool) or (isinstance(checkpoint, str)
                                             and checkpoint in _CHECKPOINT_MODES)):
        raise ConfigError(f"tiermem.wrap_blocks: checkpoint={checkpoint!r} is not valid; "
                          "use True/'full', 'selective', 'auto' or False")
    mode = (None if checkpoint is False else checkpoint if checkpoint in ("selective", "auto")
            else "full")
    if mode == "auto" and policy is not None:
        raise ConfigError(f"tiermem.wrap_blocks: checkpoint='auto' takes no policy "
                          f"(policy={policy!r}): the auto planner places the block's tensors")
    if mode == "selective" and use_reentrant:
        raise ConfigError("tiermem.wrap_blocks: checkpoint='selective' needs use_reentrant=False")
    order = None
    if policy is not None:
        if callable(policy) and not isinstance(policy, str):
            raise ConfigError("tiermem.wrap_blocks: policy must be a tier name or a list of "
                              f"them, not a callable ({policy!r})")
        order = _block_order(policy)
    if mode is None and order is None:
        raise ConfigError("tiermem.wrap_blocks: nothing to do (checkpoint=False and no policy)")
    match = _matcher(blocks)
    chosen: List[Tuple[str, nn.Module]] = []
    for name, m in model.named_modules():
        if any(name.startswith(p + ".") for p, _ in chosen):
            continue   # inside a block already chosen
        if match(name, m):
            if isinstance(m.__dict__.get("forward"), _BlockForward):
                raise ConfigError(f"tiermem.wrap_blocks: {name or type(m).__name__} is already "
                                  "wrapped; call unwrap() on the earlier BlockWrapping first")
            chosen.append((name, m))
    if not chosen:
        raise ConfigError(f"tiermem.wrap_blocks: no module of {type(model).__name__} matches "
                          f"blocks={blocks!r}")
    for _, m in chosen:
        m.forward = _BlockForward(m, mode, use_reentrant, order)
    return BlockWrapping(chosen)


def _block_order(policy: Union[str, CheckpointPolicy, Sequence]):
    """The tier order of a block's ``policy`` (a TierOrder), or ``ConfigError``."""
    entries = policy if isinstance(policy, (list, tuple)) else [policy]
    if not any(isinstance(p, CheckpointPolicy) for p in entries):
        # Parsed and checked as the Offloader's own policy setting is.
        order, _ = resolve_policy(Config.from_env({}, policy=policy).policy, nvme_dir=None)
        return order
    try:
        return tier_order(policy, source="the block policy")
    except TierMemError as e:
        raise ConfigError(f"tiermem.wrap_blocks: policy={policy!r} is not valid: "
                          f"{str(e).removeprefix('tiermem: ')}") from None


def _matcher(blocks: Selector) -> Callable[[str, nn.Module], bool]:
    if isinstance(blocks, type) or (isinstance(blocks, tuple) and blocks
                                    and all(isinstance(b, type) for b in blocks)):
        return lambda name, m: isinstance(m, blocks)
    if callable(blocks):
        return blocks
    if isinstance(blocks, (list, tuple, set)) and all(isinstance(b, str) for b in blocks):
        wanted = set(blocks)
        return lambda name, m: name in wanted
    raise ConfigError(f"tiermem.wrap_blocks: blocks={blocks!r} is not a module class, a "
                      "predicate (name, module) -> bool, or a list of qualified names")

"""What producer tracking costs a plan that recomputes, and the plan chosen
with it priced: the modules, op names and torch calls a step following a plan
tracks, and each recomputable tensor's share of their price (NOTE [Tracking
priced] in planner/runtime.py)."""

from __future__ import annotations

from typing import Optional

from ..policy import Tier
from .plan import Plan
from .profile import Profile

__all__ = ["priced_plan", "tracking_scope", "tracking_ops", "tracking_calls",
           "tracking_direct", "tracked_op_count", "direct_call_count", "tracking_shares"]


def _with_tracking(plan: Plan, profile: Profile, rates) -> Plan:
    """``plan`` with its tracking scope, op names, calls and price set."""
    plan.tracking_scope = tracking_scope(plan, profile)
    plan.tracking_ops = tracking_ops(plan, profile)
    plan.tracking_calls = tracking_calls(plan, profile)
    plan.tracking_direct = tracking_direct(plan, plan.tracking_calls, profile)
    plan.tracked_ops, plan.direct_calls = _tracked_counts(plan, profile)
    plan.predicted_tracking_s = (
        plan.tracked_ops * (getattr(rates, "track_op_s", 0.0) or 0.0)
        + plan.direct_calls * (getattr(rates, "track_call_s", 0.0) or 0.0))
    return plan


def _prefers_recompute(record) -> bool:
    """Its hint asks for recompute first (a MUST is obeyed anyway; a PREFER
    hint keeps its recompute option in both solves of NOTE [Tracking
    priced], rule 3)."""
    hint = record.hint
    return hint is not None and len(hint[0]) > 0 and hint[0][0] is Tier.RECOMPUTE


def _unreachable(plan: Plan) -> bool:
    return any(n.startswith("budget not reachable") for n in plan.notes)


def priced_plan(profile: Profile, rates, make) -> Plan:
    """``make(tracking_s=..., no_recompute=...)``'s plan, tracking priced (NOTE
    [Tracking priced], rules 2 and 3)."""
    shares = tracking_shares(profile, rates)
    plan = _with_tracking(make(tracking_s=shares), profile, rates)
    if not plan.predicted_tracking_s:
        return plan
    chosen = frozenset(t.index for t in plan.tensors
                       if t.tier == Tier.RECOMPUTE.value and not t.must)
    if not chosen:
        return plan
    other = _with_tracking(make(tracking_s=shares, no_recompute=frozenset(
        r.index for r in profile.records if not _prefers_recompute(r))), profile, rates)
    cost, other_cost = plan.predicted_step_cost_s, other.predicted_step_cost_s
    whole = (f" and {plan.direct_calls} torch calls recorded whole" if plan.direct_calls
             else "")
    what = (f"recomputing {len(chosen)} tensors needs producer tracking over "
            f"{plan.tracked_ops} ops{whole} per forward (predicted "
            f"{plan.predicted_tracking_s * 1e3:.2f} ms)")
    if _unreachable(other):   # fewer bytes freed: the budget needs them
        plan.notes.append(f"tracking: {what}; the budget is not reachable without them")
        return plan
    if other_cost >= cost:
        plan.notes.append(f"tracking: {what}; worth it: without them the predicted step "
                          f"cost is {other_cost * 1e3:.2f} ms, with them {cost * 1e3:.2f} ms")
        return plan
    other.notes.append(f"tracking: the plan recomputing them was declined: {what}; "
                       f"predicted step cost {cost * 1e3:.2f} ms with them, "
                       f"{other_cost * 1e3:.2f} ms without")
    return other


def _recipe_pairs(plan: Plan, profile: Profile, field: str) -> Optional[list]:
    """The profile's ``field`` (``recipe_ops``, ``recipe_calls``) of every
    tensor ``plan`` recomputes, joined; ``None`` if one was not recorded."""
    pairs: list = []
    for record, order in zip(profile.records, plan.orders):
        if order[0] is not Tier.RECOMPUTE:
            continue
        got = getattr(record, field)
        if not got:
            return None
        pairs.extend(got)
    return pairs


def tracking_scope(plan: Plan, profile: Profile) -> Optional[frozenset]:
    """The modules a step following ``plan`` tracks producers in: those that ran
    the recipe ops of the tensors it recomputes, as its profile recorded them
    (``""``: outside every module; empty: it recomputes nothing); ``None``
    (the whole forward) when one was not recorded. NOTE [Scoped tracking] in
    tracking/modules.py."""
    names: set = set()
    for record, order in zip(profile.records, plan.orders):
        if order[0] is not Tier.RECOMPUTE:
            continue
        modules = record.recipe_modules
        if not modules:
            return None
        names.update(modules)
    return frozenset(names)


def tracking_ops(plan: Plan, profile: Profile) -> Optional[dict]:
    """Per module of :func:`tracking_scope`, the names of the ops the recipes
    of the tensors ``plan`` recomputes ran there, as its profile recorded them;
    ``None`` (every recomputable op) when one was not recorded. NOTE
    [Recording only what recipes use] in tracking/producers.py."""
    pairs = _recipe_pairs(plan, profile, "recipe_ops")
    if pairs is None:
        return None
    ops: dict = {}
    for module, name in pairs:
        ops.setdefault(module, set()).add(name)
    return {m: frozenset(n) for m, n in ops.items()}


def tracking_calls(plan: Plan, profile: Profile) -> Optional[dict]:
    """Per module of :func:`tracking_scope`, the names of the torch calls the
    ops of the recipes of the tensors ``plan`` recomputes ran in there, as its
    profile recorded them (``None`` for a module where one ran outside every
    torch call: all of it is tracked); ``None`` when a recipe's calls were not
    recorded. NOTE [Tracking inside torch calls] in tracking/modules.py."""
    pairs = _recipe_pairs(plan, profile, "recipe_calls")
    if pairs is None:
        return None
    calls: dict = {}
    for module, call in pairs:
        if call is None:
            calls[module] = None
        elif module not in calls:
            calls[module] = {call}
        elif calls[module] is not None:
            calls[module].add(call)
    return {m: None if c is None else frozenset(c) for m, c in calls.items()}


def tracking_direct(plan: Plan, calls: Optional[dict], profile: Profile) -> Optional[dict]:
    """Of ``calls`` (``plan``'s :func:`tracking_calls`), per module, those the
    profile saw run one recomputable op each, by that op's name,
    and whose returned tensors hold every output of theirs that ``plan``'s
    recipes use: a step records them whole (NOTE [Calls recorded whole] in
    tracking/producers.py); ``None`` when ``calls`` is."""
    if calls is None:
        return None
    single = profile.single_op_calls
    unreturned: set = set()
    for record, order in zip(profile.records, plan.orders):
        if order[0] is Tier.RECOMPUTE:
            unreturned.update(record.recipe_unreturned)
    direct: dict = {}
    for module, names in calls.items():
        if names is None:
            continue
        got = {c: single[(module, c)] for c in names
               if (module, c) in single and (module, c) not in unreturned}
        if got:
            direct[module] = got
    return direct


def _pair_ops(profile: Profile, module: Optional[str], call: Optional[str]) -> int:
    """Ops a step tracking (``module``, ``call``) tracks: ``call`` ``None``: all
    of ``module``; ``module`` ``None``: every op of the forward (rule 1 of NOTE
    [Tracking priced])."""
    ops = profile.call_ops
    if module is None:
        return sum(ops.values())
    if call is None:
        return sum(n for (m, _), n in ops.items() if m == module)
    return ops.get((module, call), 0)


def _record_pairs(record) -> tuple:
    """The (module, call) pairs ``record``'s recipe needs tracked; ``((None,
    None),)``: the whole forward (its modules were not recorded)."""
    if record.recipe_calls:
        return tuple(record.recipe_calls)
    if record.recipe_modules:
        return tuple((m, None) for m in record.recipe_modules)
    return ((None, None),)


def _tracked_counts(plan: Plan, profile: Profile) -> tuple:
    """``(tracked_op_count, direct_call_count)`` of ``plan``, in one pass."""
    if not profile.call_ops:
        return 0, 0
    scope = tracking_scope(plan, profile)
    if scope is None:
        return _pair_ops(profile, None, None), 0
    calls = tracking_calls(plan, profile)
    direct = tracking_direct(plan, calls, profile) or {}
    ops = whole_calls = 0
    for module in scope:
        names = None if calls is None else calls.get(module)
        if names is None:
            ops += _pair_ops(profile, module, None)
            continue
        whole = direct.get(module, {})
        for c in names:
            if c in whole:
                whole_calls += _pair_ops(profile, module, c)
            else:
                ops += _pair_ops(profile, module, c)
    return ops, whole_calls


def tracked_op_count(plan: Plan, profile: Profile) -> int:
    """Aten ops per forward a step following ``plan`` hands the dispatch mode,
    as the profile counted them (0: it recomputes nothing, or nothing was
    counted); the calls it records whole are :func:`direct_call_count`'s.
    NOTE [Tracking priced]."""
    return _tracked_counts(plan, profile)[0]


def direct_call_count(plan: Plan, profile: Profile) -> int:
    """Torch calls per forward a step following ``plan`` records whole (each
    one op in the profile: NOTE [Calls recorded whole] in tracking/producers.py)."""
    return _tracked_counts(plan, profile)[1]


def tracking_shares(profile: Profile, rates) -> dict:
    """Pack index -> seconds of tracking charged to recomputing it (rule 2 of
    NOTE [Tracking priced]); empty when nothing was counted or tracking is
    free here."""
    per_op = getattr(rates, "track_op_s", 0.0) or 0.0
    if not profile.call_ops or per_op <= 0:
        return {}
    per_call = getattr(rates, "track_call_s", 0.0) or 0.0
    single = profile.single_op_calls
    users: dict = {}
    for r in profile.records:
        if r.recomputable:
            for pair in set(_record_pairs(r)):
                users[pair] = users.get(pair, 0) + 1
    shares = {}
    for r in profile.records:
        if r.recomputable:
            shares[r.index] = sum(
                _pair_ops(profile, m, c) * (per_call if (m, c) in single else per_op)
                / users[(m, c)] for m, c in set(_record_pairs(r)))
    return shares
"""Every rank plans from the same numbers: under
``torch.distributed`` an auto Offloader agrees once with the other ranks on the
inputs of its plans, so that ranks fed the same step do not drift apart.

What is agreed (:func:`combine`, from one row per rank):

- the device budget: the smallest (a size: the fewest bytes; a percentage:
  the smallest share; unset: each rank's default measured then, the fewest
  bytes). A percentage on some ranks and a size on others is a
  :class:`ConfigError` raised on every rank;
- the measured rates: per rate the slowest (host copy, pointwise, D2H, H2D,
  disk write and read, both directions at once, the CPU rate of moves, the
  fewest compute threads), per request latency and fixed CPU cost the longest; a rate a rank could
  not measure (a disk probe that failed) is absent for all;
- the cpu and nvme budgets the solver fills (the smallest); each tier still
  enforces its own rank's budget, which is never smaller;
- the timeline of the first profile (when each tensor was saved and first
  needed, its regeneration time, the bytes the profile measured), taken from
  one rank, only when every rank's first profile is finished and has the same
  structure (the same shape, dtype and device type per saved tensor): the
  rank with the shortest profiled step (its windows are the shortest: with
  the slowest link they make the most cautious prediction), the lowest rank
  on a tie.

The guarantee: the first plan is identical on every rank (the same tier for
each tensor, the same predictions) when every rank's first profiled step ran
its backward before its second step began and all have the same structure;
otherwise every rank plans from the agreed budgets and rates and its own
timeline (alike, not identical). Later plans (a new shape, a closed-loop
correction) are made by one rank alone, from the agreed budgets and rates
and that rank's own profile, without a collective (NOTE [Ranks agree once])."""

# NOTE [Ranks agree once]
# A collective that only some ranks enter waits forever. Plans are made when a
# rank's profile finishes, which depends on its own data, on the closed loop
# and on when the user reads ``off.plan``: no collective may run there. So the
# exchange runs at one point, fixed by a count rather than by state: the entry
# of each auto Offloader's AGREE_AT_STEP-th step, before its forward
# (``Planner.begin_step``), when ``agree_ranks`` is on, torch.distributed is
# initialised, the default group has more than one rank and its backend takes
# the exchange's tensor (gloo or MPI: CPU; NCCL: the current CUDA device).
# Each condition is the same on every rank of an SPMD job, and all enter that
# step at the same point of their programs, so all enter the exchange, in the
# same order relative to the program's own collectives: one all_gather of a
# fixed-size row, then a broadcast of the timeline only when the gathered
# table (the same everywhere) says so. No collective runs later: later plans
# reuse the agreed numbers; ``off.plan`` before the exchange is ``None``.

# NOTE [Every rank enters the exchange]
# A rank whose first profile is not finished (its forward raised, or forwards
# ran ahead of backwards) still takes part, with no figures (neutral in every
# minimum), and so does a rank whose own measurement raised (``Planner._agree``
# guards it). What breaks NOTE [Ranks agree once], and needs
# ``agree_ranks=False`` (TIERMEM_AGREE_RANKS=0): an auto Offloader on only some
# ranks of the default group (a pipeline stage of its own, a sub-mesh), or a
# different number of entries before the exchange's step on some ranks (an
# extra forward under it on rank 0 only). The default group is always the one
# used: all ranks of the job agree, whatever meshes or subgroups the model uses.

from __future__ import annotations

import hashlib
import logging
import math
from dataclasses import dataclass, replace
from typing import List, Optional, Sequence, Union

import torch

from ..config import BudgetShare
from ..errors import ConfigError
from ..telemetry import format_bytes
from .profile import Profile
from .rates import Rates

__all__ = ["Agreement", "AGREE_AT_STEP", "active", "collective_device_type",
           "structure_hash", "local_row", "combine", "exchange"]

_log = logging.getLogger("tiermem")

#: The step (entry count of the Offloader) at which the ranks agree.
AGREE_AT_STEP = 2

_RATES_MIN = ("host_copy", "pointwise", "d2h", "h2d", "disk_write", "disk_read",
              "link_both", "disk_both", "move_cpu", "compute_threads")
_RATES_MAX = ("disk_write_latency_s", "disk_read_latency_s", "measured_seconds",
              "move_fixed_cpu_s", "track_op_s",
              "track_call_s")
# Row layout (float64, NaN = "this rank has no figure").
_RANK, _HAS_RATES = 0, 1
_RATE0 = 2                                  # _RATES_MIN then _RATES_MAX
_KIND = _RATE0 + len(_RATES_MIN) + len(_RATES_MAX)
_BUDGET, _CPU, _NVME, _HAS_PROFILE, _HASH, _COUNT, _STEP_S = range(_KIND + 1, _KIND + 8)
ROW = _STEP_S + 1
_DEFAULT, _BYTES, _SHARE = 0.0, 1.0, 2.0
_KIND_NAMES = {_DEFAULT: "unset (free memory)", _BYTES: "a size", _SHARE: "a percentage"}
# Per record of the broadcast timeline, then the profile's own figures.
_REC_FIELDS = ("nbytes", "pack_s", "first_use_s", "recompute_s", "recomputable",
               "input_kept_bytes", "unpack_s", "leaf_use_s", "leaf_reader")
_PROFILE_FIELDS = ("fixed_kept_bytes", "forward_end_s", "backward_start_s", "backward_end_s",
                   "measured_kept_bytes")


def collective_device_type(backend: str) -> Optional[str]:
    """Where the exchange's tensors live for a group of ``backend``
    (``str(dist.get_backend())``): ``"cpu"`` for gloo and MPI (and a combined
    ``cpu:gloo,cuda:nccl`` group, whose CPU tensors go to gloo), ``"cuda"``
    (the current device) for NCCL, ``None`` for a backend not known to take
    either (the exchange is then skipped on every rank, with a warning)."""
    b = backend.lower()
    if "cpu:" in b or b in ("gloo", "mpi"):
        return "cpu"
    if b == "nccl":
        return "cuda"
    return None


def active(enabled: bool) -> bool:
    """Whether the ranks agree (NOTE [Ranks agree once]): ``enabled`` (the
    ``agree_ranks`` setting) and an initialised default group of more than
    one rank."""
    if not enabled:
        return False
    import torch.distributed as dist
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def structure_hash(keys) -> int:
    """A 48-bit hash of a step's structure: per saved tensor its shape, dtype
    and device *type* (ranks on different GPUs have the same structure)."""
    h = hashlib.sha1()
    for shape, dtype, device in keys:
        h.update(f"{tuple(shape)}|{dtype}|{torch.device(device).type};".encode())
    return int(h.hexdigest()[:12], 16)


def _num(x) -> float:
    return math.nan if x is None else float(x)


def local_row(rank: int, rates: Optional[Rates], budget: Union[int, BudgetShare, None],
              default_budget_bytes: Optional[int], cpu_budget_bytes: int,
              nvme_budget_bytes: Optional[int], profile: Optional[Profile]) -> List[float]:
    """This rank's row of the exchange. ``budget``: the ``device_budget``
    setting; ``default_budget_bytes``: the default measured now when it is
    unset (``None``: not measurable yet); ``profile``: the first profile,
    finished (its backward ran), else ``None``."""
    row = [math.nan] * ROW
    row[_RANK] = rank
    row[_HAS_RATES] = 0.0 if rates is None else 1.0
    if rates is not None:
        for i, name in enumerate(_RATES_MIN + _RATES_MAX):
            row[_RATE0 + i] = _num(getattr(rates, name))
    if isinstance(budget, BudgetShare):
        row[_KIND], row[_BUDGET] = _SHARE, budget.fraction
    elif budget is not None:
        row[_KIND], row[_BUDGET] = _BYTES, budget
    else:
        row[_KIND], row[_BUDGET] = _DEFAULT, _num(default_budget_bytes)
    row[_CPU], row[_NVME] = cpu_budget_bytes, _num(nvme_budget_bytes)
    row[_HAS_PROFILE] = 0.0 if profile is None else 1.0
    if profile is not None:
        row[_HASH] = structure_hash(profile.keys)
        row[_COUNT] = len(profile.records)
        row[_STEP_S] = _num(profile.backward_end_s)
    return row


@dataclass
class Agreement:
    """The numbers every rank plans from (see the module docstring)."""

    #: Ranks that agreed (the default group's size).
    ranks: int
    #: Slowest rates; ``None`` when no rank had measured any (each plans from its own).
    rates: Optional[Rates]
    #: The agreed ``device_budget``: bytes, a share, or ``None`` (each rank's own default).
    device_budget: Union[int, BudgetShare, None]
    cpu_budget_bytes: int
    nvme_budget_bytes: Optional[int]
    #: The rank whose first-profile timeline every rank plans from, or ``None``.
    timeline_rank: Optional[int]
    #: Why the timeline was not agreed ("" when it was).
    timeline_note: str = ""
    #: :func:`structure_hash` of the agreed first profile.
    structure: Optional[int] = None
    #: The broadcast timeline (``_REC_FIELDS`` per record, then ``_PROFILE_FIELDS``).
    timeline: Optional[Sequence[float]] = None

    def as_dict(self) -> dict:
        """JSON-ready (the timeline itself left out)."""
        return {"ranks": self.ranks,
                "rates": None if self.rates is None else self.rates.as_dict(),
                "device_budget": (str(self.device_budget)
                                  if isinstance(self.device_budget, BudgetShare)
                                  else self.device_budget),
                "cpu_budget_bytes": self.cpu_budget_bytes,
                "nvme_budget_bytes": self.nvme_budget_bytes,
                "timeline_rank": self.timeline_rank, "timeline_note": self.timeline_note}

    def apply(self, profile: Profile) -> Profile:
        """``profile`` with the agreed timeline when it is the agreed profile
        (same structure), else ``profile`` itself."""
        if self.timeline is None or structure_hash(profile.keys) != self.structure:
            return profile
        n, k = len(profile.records), len(_REC_FIELDS)
        vals = self.timeline
        records = []
        for i, r in enumerate(profile.records):
            v = dict(zip(_REC_FIELDS, vals[i * k:(i + 1) * k]))
            records.append(replace(
                r, nbytes=int(v["nbytes"]), pack_s=v["pack_s"],
                first_use_s=None if math.isnan(v["first_use_s"]) else v["first_use_s"],
                recompute_s=None if math.isnan(v["recompute_s"]) else v["recompute_s"],
                recomputable=bool(v["recomputable"]),
                input_kept_bytes=int(v["input_kept_bytes"]),
                unpack_s=None if math.isnan(v["unpack_s"]) else v["unpack_s"],
                leaf_use_s=None if math.isnan(v["leaf_use_s"]) else v["leaf_use_s"],
                leaf_reader=None if math.isnan(v["leaf_reader"]) else int(v["leaf_reader"])))
        p = dict(zip(_PROFILE_FIELDS, vals[n * k:]))
        nan_none = lambda x: None if math.isnan(x) else x   # noqa: E731
        return replace(profile, records=records, fixed_kept_bytes=int(p["fixed_kept_bytes"]),
                       forward_end_s=p["forward_end_s"],
                       backward_start_s=nan_none(p["backward_start_s"]),
                       backward_end_s=nan_none(p["backward_end_s"]),
                       measured_kept_bytes=int(p["measured_kept_bytes"]))

    def describe(self, profile: Optional[Profile] = None) -> str:
        """One line: the agreed numbers and where they came from (a plan's
        note and the log line of the exchange)."""
        b = self.device_budget
        budget = ("each rank's own default" if b is None
                  else str(b) if isinstance(b, BudgetShare) else format_bytes(b))
        parts = [f"device budget {budget}", f"cpu budget {format_bytes(self.cpu_budget_bytes)}"]
        if self.nvme_budget_bytes is not None:
            parts.append(f"nvme budget {format_bytes(self.nvme_budget_bytes)}")
        r = self.rates
        if r is None:
            parts.append("rates: each rank's own (none measured)")
        else:
            gb = lambda x: "absent" if x is None else f"{x / 1e9:.2f} GB/s"   # noqa: E731
            rates = f"host copy {gb(r.host_copy)}"
            if r.d2h is not None or r.h2d is not None:
                rates += f", D2H {gb(r.d2h)}, H2D {gb(r.h2d)}"
            if r.disk_write is not None or r.disk_read is not None:
                rates += f", disk write {gb(r.disk_write)}, read {gb(r.disk_read)}"
            parts.append(f"slowest rates: {rates}")
        if profile is not None and self.timeline is not None and \
                structure_hash(profile.keys) == self.structure:
            parts.append(f"timeline of rank {self.timeline_rank} (the shortest profiled step)")
        elif profile is not None:
            parts.append("timeline: this rank's own"
                         + (f" ({self.timeline_note})" if self.timeline_note else ""))
        return (f"planned from numbers agreed by {self.ranks} ranks (the smallest "
                f"budgets and the slowest rates of them all): " + "; ".join(parts))


def _min_or_none(values) -> Optional[float]:
    values = list(values)
    if not values or any(math.isnan(v) for v in values):
        return None
    return min(values)


def combine(rows: Sequence[Sequence[float]]) -> Agreement:
    """The agreement from every rank's :func:`local_row` (the same on every
    rank: a pure function of the gathered table). The timeline's values are
    not filled (see :func:`exchange`). Raises :class:`ConfigError` when the
    ranks' ``device_budget`` settings are of different kinds."""
    rows = [list(r) for r in rows]
    world = len(rows)
    measured = [r for r in rows if r[_HAS_RATES] == 1.0]
    rates = None
    if measured:
        vals = {}
        for i, name in enumerate(_RATES_MIN + _RATES_MAX):
            col = [r[_RATE0 + i] for r in measured]
            if name in _RATES_MAX:
                vals[name] = max((v for v in col if not math.isnan(v)), default=0.0)
            else:
                vals[name] = _min_or_none(col)
        rates = Rates(disk_engine=None, **vals)
    kinds = {r[_KIND] for r in rows}
    if _SHARE in kinds and len(kinds) > 1:
        shown = ", ".join(
            f"rank {int(r[_RANK])} {_KIND_NAMES[r[_KIND]]}" for r in rows)
        raise ConfigError(
            f"tiermem: device_budget differs in kind across ranks ({shown}): the ranks "
            "cannot agree on one budget; set the same kind on every rank (or agree_ranks=False "
            "/ TIERMEM_AGREE_RANKS=0 to plan each rank alone)")
    budgets = [r[_BUDGET] for r in rows if not math.isnan(r[_BUDGET])]
    if not budgets:
        device_budget = None
    elif _SHARE in kinds:
        device_budget = BudgetShare(min(budgets))
    else:
        device_budget = int(min(budgets))
    nvme = [r[_NVME] for r in rows if not math.isnan(r[_NVME])]
    agreement = Agreement(world, rates, device_budget, int(min(r[_CPU] for r in rows)),
                          int(min(nvme)) if nvme else None, None)
    if not all(r[_HAS_PROFILE] == 1.0 for r in rows):
        agreement.timeline_note = ("not every rank had finished its first profiled step "
                                   "when the ranks agreed")
    elif len({(r[_HASH], r[_COUNT]) for r in rows}) > 1:
        agreement.timeline_note = "the ranks' first profiled steps differ in structure"
    else:
        step = [math.inf if math.isnan(r[_STEP_S]) else r[_STEP_S] for r in rows]
        agreement.timeline_rank = min(range(world), key=lambda i: (step[i], i))
        agreement.structure = int(rows[0][_HASH])
    return agreement


def _timeline(profile: Profile) -> List[float]:
    out = []
    for r in profile.records:
        out.extend(_num(getattr(r, f)) for f in _REC_FIELDS)
    out.extend(_num(getattr(profile, f)) for f in _PROFILE_FIELDS)
    return out


def exchange(row: List[float], profile: Optional[Profile],
             cuda_device: Optional[str] = None) -> Optional[Agreement]:
    """Run the exchange on the default group (every rank calls it at the same
    point: NOTE [Ranks agree once]): all_gather the rows, combine them, and
    broadcast the timeline from the chosen rank when there is one. ``None``
    when the group's backend takes neither CPU nor CUDA tensors. Over NCCL
    the tensors are on ``cuda_device`` (the device of this rank's model, as
    its profile names it), else on the current CUDA device."""
    import torch.distributed as dist
    backend = str(dist.get_backend())
    kind = collective_device_type(backend)
    if kind is None:
        _log.warning("tiermem: auto: the default process group's backend %r is not one the "
                     "ranks can agree over (gloo, mpi, nccl); each rank plans from its own "
                     "numbers", backend)
        return None
    if kind != "cuda":
        device = torch.device("cpu")
    elif cuda_device is not None and torch.device(cuda_device).index is not None:
        device = torch.device(cuda_device)
    else:
        device = torch.device("cuda", torch.cuda.current_device())
    mine = torch.tensor(row, dtype=torch.float64, device=device)
    table = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(table, mine)
    agreement = combine([t.tolist() for t in table])
    if agreement.timeline_rank is not None:
        n = len(_REC_FIELDS) * int(row[_COUNT]) + len(_PROFILE_FIELDS)
        buf = (torch.tensor(_timeline(profile), dtype=torch.float64, device=device)
               if dist.get_rank() == agreement.timeline_rank
               else torch.empty(n, dtype=torch.float64, device=device))
        dist.broadcast(buf, src=agreement.timeline_rank)
        agreement.timeline = buf.tolist()
    return agreement

"""Settings of tiermem: the :class:`Config` dataclass and its ``TIERMEM_*`` variables.

Every setting is declared once, as a dataclass field whose metadata holds its
environment variable, its parser and its documentation. ``Config.from_env``,
the validation of keyword arguments and the README's table
(:func:`env_table_markdown`) are all derived from those declarations.

Precedence: keyword argument > environment variable > default.
"""

from __future__ import annotations

import dataclasses
import difflib
import fractions
import logging
import os
import re
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Union

from .errors import ConfigError, TierMemError

__all__ = ["Config", "env_table_markdown", "parse_size", "parse_bool", "parse_int",
           "BudgetShare", "parse_device_budget"]

_log = logging.getLogger("tiermem")

POLICY_NAMES = ("keep", "cpu", "nvme", "recompute", "auto")
ENGINE_NAMES = ("auto", "cpp", "python")
LOG_LEVELS = ("debug", "info", "warning", "error")
#: Most I/O threads an engine may have: more gains nothing on any NVMe drive
#: (queue depth is per request, not per thread) and only costs OS threads.
MAX_IO_THREADS = 128

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2,
    "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$", re.ASCII)
_TRUE = ("1", "true", "on", "yes")
_FALSE = ("0", "false", "off", "no")


def parse_size(text: str, *, name: str) -> int:
    """Parse ``4096``, ``512MiB``, ``16GB`` (decimal kB/MB/GB, binary KiB/MiB/GiB) to bytes.

    Raises :class:`ConfigError` naming ``name`` and the value when it is not a size.
    """
    m = _SIZE_RE.match(str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _SIZE_UNITS:
        raise ConfigError(
            f"tiermem: {name}={text!r} is not a size; use bytes or a suffix, "
            "e.g. 4096, 512MiB, 16GB")
    number = fractions.Fraction(m.group(1)) * _SIZE_UNITS[unit]
    if number.denominator != 1:
        raise ConfigError(f"tiermem: {name}={text!r} is not a whole number of bytes")
    return int(number)


@dataclass(frozen=True)
class BudgetShare:
    """A budget given as a share (``"50%"`` -> ``BudgetShare(0.5)``) of a figure
    measured at run time (for ``device_budget``: the saved bytes a plain step
    keeps, measured by the planner's profile). ``fraction`` is in [0, 1]."""

    fraction: float

    def __str__(self) -> str:
        return f"{self.fraction * 100:g}%"


_PERCENT_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*%\s*$", re.ASCII)


def parse_device_budget(text: str, *, name: str) -> Union[int, BudgetShare]:
    """Parse a device budget: a size (``12GiB``, ``4096``; see :func:`parse_size`)
    or a percentage from 0% to 100% (``50%``, ``12.5%``) of the saved bytes a
    plain step keeps. ``0`` / ``0%`` mean "keep as little as the tiers allow".
    Raises :class:`ConfigError` naming ``name`` and the value otherwise
    (``-1``, ``150%``, ``12 GiBs``)."""
    m = _PERCENT_RE.match(str(text))
    if m is not None:
        pct = float(m.group(1))
        if pct > 100:
            raise ConfigError(
                f"tiermem: {name}={text!r} is more than 100% of what a plain step keeps; "
                "use at most 100% (keep everything), or a size such as 12GiB")
        return BudgetShare(pct / 100)
    if "%" in str(text):
        raise ConfigError(f"tiermem: {name}={text!r} is not a percentage; use e.g. 50%")
    try:
        return parse_size(text, name=name)
    except ConfigError:
        raise ConfigError(
            f"tiermem: {name}={text!r} is not a device budget; use a size (4096, 512MiB, "
            "12GiB) or a percentage of what a plain step keeps (50%)") from None


def parse_bool(text: str, *, name: str) -> bool:
    """Parse ``1/0/true/false/on/off/yes/no`` (any case)."""
    low = str(text).strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ConfigError(
        f"tiermem: {name}={text!r} is not a boolean; use one of 1/0/true/false/on/off/yes/no")


def _choice(choices: tuple[str, ...]) -> Callable[[str, str], str]:
    def parse(text: str, name: str) -> str:
        low = str(text).strip().lower()
        if low not in choices:
            raise ConfigError(
                f"tiermem: {name}={text!r} is not valid; choose one of {', '.join(choices)}")
        return low
    return parse


def _policy(text: str, name: str) -> str:
    """One policy name, or a comma-separated preference list of tier names."""
    parts = [p.strip().lower() for p in str(text).split(",")]
    bad = [p for p in parts if p not in POLICY_NAMES]
    if bad or (len(parts) > 1 and "auto" in parts):
        raise ConfigError(
            f"tiermem: {name}={text!r} is not valid; choose one of {', '.join(POLICY_NAMES)} "
            "or a comma-separated preference list of tiers such as 'recompute,cpu'")
    return ",".join(parts)


_INT_RE = re.compile(r"^\s*([0-9]+)\s*$", re.ASCII)


def parse_int(text: str, *, name: str) -> int:
    """Parse a whole number written in ASCII digits (``8``, `` 8 ``).

    ``int()`` alone would also take ``4_0`` (as 40), ``+4`` and digits of other
    scripts (``٤``, ``５``), none of which anyone means as a thread count; like
    sizes (:func:`parse_size`), an integer setting is ASCII digits only.
    Raises :class:`ConfigError` naming ``name`` and the value otherwise.
    """
    m = _INT_RE.match(str(text))
    if m is None:
        raise ConfigError(
            f"tiermem: {name}={text!r} is not an integer; use ASCII digits only, e.g. 8")
    return int(m.group(1))


def _by_name(parse: Callable) -> Callable[[str, str], Any]:
    """``parse_x(text, *, name)`` as a setting's parser ``(text, name)``."""
    return lambda text, name: parse(text, name=name)


_size, _device_budget, _bool, _int = (
    _by_name(p) for p in (parse_size, parse_device_budget, parse_bool, parse_int))


def _path(text: str, name: str) -> str:
    text = str(text)
    if not text.strip():
        raise ConfigError(f"tiermem: {name}={text!r} is an empty path")
    if "\x00" in text:   # only an argument can hold one; os.* would raise a bare ValueError
        raise ConfigError(f"tiermem: {name}={text!r} contains a null byte, which no path may")
    return os.path.abspath(os.path.expanduser(text))


def _setting(env: str, parse: Callable[[str, str], Any], doc: str, default: Any = None,
             default_doc: Optional[str] = None, minimum: Optional[int] = None,
             maximum: Optional[int] = None) -> Any:
    meta = {"env": env, "parse": parse, "doc": doc, "min": minimum, "max": maximum,
            "default_doc": default_doc if default_doc is not None else repr(default)}
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class Config:
    """Every setting of tiermem. Field ``x`` is read from ``TIERMEM_X``.

    Build one with :meth:`from_env` (environment + keyword overrides); the
    constructor itself validates nothing beyond what :meth:`from_env` does, so
    prefer ``Config.from_env(**kwargs)``. ``None`` on a budget means "derive a
    default at run time" (see the README).

    Under a distributed launch every rank reads its own Config: an explicit
    budget (``cpu_budget``, ``nvme_budget``, ``prefetch_bytes``) is per rank; a
    default derived from the node's RAM or disk is divided by
    ``LOCAL_WORLD_SIZE`` (the node's ranks together stay within its defaults).
    """

    policy: Union[str, Callable, None] = _setting(
        "TIERMEM_POLICY", _policy,
        "Tier policy: keep, cpu, nvme, recompute, or a preference list such as "
        "`recompute,cpu` (recompute what is eligible, else cpu); argument: also a callable "
        "`(TensorInfo) -> Tier`. Unset: cpu for CUDA tensors; on the CPU nvme if "
        "an NVMe dir is set, else keep.", default_doc="unset")
    nvme_dir: Optional[str] = _setting(
        "TIERMEM_NVME_DIR", _path, "Directory for the NVMe tier's files.", default_doc="unset")
    min_offload_bytes: int = _setting(
        "TIERMEM_MIN_OFFLOAD_BYTES", _size,
        "Saved tensors smaller than this stay where they are (a transfer this small "
        "costs more in launch latency than it saves).", default=64 * 1024,
        default_doc="64KiB", minimum=0)
    cpu_budget: Optional[int] = _setting(
        "TIERMEM_CPU_BUDGET", _size,
        "Most host bytes the cpu tier holds, per rank; when full, tensors stay on the "
        "device (one warning). Unset: half the RAM available at start (in a container with "
        "a memory limit, at most half of what the limit leaves), divided by "
        "LOCAL_WORLD_SIZE.", default_doc="auto", minimum=0)
    nvme_budget: Optional[int] = _setting(
        "TIERMEM_NVME_BUDGET", _size,
        "Most bytes the nvme tier keeps on disk, per rank; when full (or on ENOSPC), "
        "tensors go to the cpu tier, else stay on the device. Unset: 80% of the dir's "
        "free space at start, divided by LOCAL_WORLD_SIZE.", default_doc="auto", minimum=0)
    device_budget: Union[int, BudgetShare, None] = _setting(
        "TIERMEM_DEVICE_BUDGET", _device_budget,
        "policy=auto: bytes of saved activations allowed to stay where they were made (GPU "
        "memory for CUDA tensors, RAM for CPU tensors), per rank: a size, or a percentage "
        "(0% to 100%) of what a plain step keeps, measured by the planner's first step. "
        "Unset: the device's free memory less a tenth of its total (on the CPU: available "
        "RAM, at most what a container's memory limit leaves), measured when the plan is "
        "made; if everything fits, nothing moves.",
        default_doc="auto", minimum=0)
    agree_ranks: bool = _setting(
        "TIERMEM_AGREE_RANKS", _bool,
        "policy=auto under torch.distributed (default group of 2+ ranks): every rank plans "
        "from the same numbers: the smallest device, cpu and nvme budgets and the slowest "
        "measured rates of all ranks (and, when the ranks' first profiled steps have the same "
        "structure, one rank's timeline), agreed by one all_gather at each auto Offloader's "
        "second step. Must be the same on every rank. 0: each rank plans alone.",
        default=True, default_doc="1")
    prefetch_bytes: Optional[int] = _setting(
        "TIERMEM_PREFETCH_BYTES", _size,
        "Most bytes brought back ahead of need in backward (restored but not yet "
        "used). Unset: a quarter of the bytes the step moved (cpu + nvme), at least "
        "16MiB and at most 256MiB.", default_doc="auto", minimum=0)
    tail_hold_bytes: Optional[int] = _setting(
        "TIERMEM_TAIL_HOLD_BYTES", _size,
        "Fixed and callable policies: the sources of the last moved tensors, up to this many "
        "bytes in packing order, stay in memory after their move lands, so that backward's "
        "first unpacks take them without a read; device memory from the "
        "forward to those unpacks is higher by at most this. 0: off. Unset: the prefetch "
        "window (`prefetch_bytes`, else a quarter of the bytes moved so far, 16MiB to "
        "256MiB). Not used by steps that follow an auto plan.", default_doc="auto", minimum=0)
    engine: str = _setting(
        "TIERMEM_ENGINE", _choice(ENGINE_NAMES),
        "NVMe I/O engine: auto (C++, else Python with a warning), cpp, python.",
        default="auto", default_doc="auto")
    io_threads: int = _setting(
        "TIERMEM_IO_THREADS", _int, "Worker threads of the I/O engine (1 to 128).",
        default=4, default_doc="4", minimum=1, maximum=MAX_IO_THREADS)
    verify: bool = _setting(
        "TIERMEM_VERIFY", _bool, "Checksum each NVMe tensor and check it on read.",
        default=False, default_doc="0")
    check_params: bool = _setting(
        "TIERMEM_CHECK_PARAMS", _bool,
        "Fingerprint the parameters a recompute reads, at pack and at recompute, and raise "
        "if one was changed in place through `.data` between forward and backward "
        "(otherwise unseen: the recompute would use the new values).",
        default=True, default_doc="1")
    disable: bool = _setting(
        "TIERMEM_DISABLE", _bool, "Turn every Offloader into a no-op.",
        default=False, default_doc="0")
    log: str = _setting(
        "TIERMEM_LOG", _choice(LOG_LEVELS),
        "Log level of the `tiermem` logger (unset: left to your logging setup).",
        default="warning", default_doc="unset")

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None, **overrides: Any) -> "Config":
        """Read ``TIERMEM_*`` from ``environ`` (default ``os.environ``), then apply
        keyword ``overrides`` (field names). ``None`` overrides are ignored, so
        ``Offloader(policy=None)`` means "not given".

        Raises :class:`ConfigError` for unknown names and bad values.
        """
        environ = os.environ if environ is None else environ
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - set(known))
        if unknown:
            raise ConfigError(
                f"tiermem: unknown setting(s) {', '.join(unknown)}; valid: {', '.join(known)}")
        values: dict[str, Any] = {}
        for name, f in known.items():
            env = f.metadata["env"]
            if overrides.get(name) is not None:
                values[name] = _from_argument(f, overrides[name])
            elif environ.get(env, "").strip() != "":
                text = environ[env]
                values[name] = _check_min(f, f.metadata["parse"](text, env), env, shown=text)
        _warn_unknown_variables(environ, {f.metadata["env"] for f in known.values()})
        cfg = cls(**values)
        cfg._set_arguments(n for n, v in overrides.items() if v is not None)
        if "log" in values:  # only when asked: never override the user's own logging setup
            _log.setLevel(getattr(logging, cfg.log.upper()))
        return cfg

    def replace(self, **changes: Any) -> "Config":
        """A copy with ``changes`` validated like keyword arguments."""
        checked = {}
        for name, value in changes.items():
            fields = {f.name: f for f in dataclasses.fields(self)}
            if name not in fields:
                raise ConfigError(f"tiermem: unknown setting {name}; valid: {', '.join(fields)}")
            checked[name] = None if value is None else _from_argument(fields[name], value)
        copy = dataclasses.replace(self, **checked)
        given = {n for n, v in checked.items() if v is not None}
        copy._set_arguments((self._arguments - set(checked)) | given)
        return copy

    #: Settings given as keyword arguments (NOTE [Setting names in messages]).
    #: A plain class attribute, set on the instance by :meth:`from_env` and
    #: :meth:`replace`; unannotated, so that it is no field, not even a ClassVar
    #: one in ``__dataclass_fields__`` (which offload() iterates).
    _arguments = frozenset()

    def _set_arguments(self, names) -> None:
        object.__setattr__(self, "_arguments", frozenset(names))   # frozen dataclass

    def setting_name(self, name: str) -> str:
        """How the user gave setting ``name``, for a message about its value: the
        argument (``nvme_dir``) when it came from a keyword argument, else its
        variable (``TIERMEM_NVME_DIR``): the message names what the user wrote."""
        if name in self._arguments:
            return name
        for f in dataclasses.fields(self):
            if f.name == name:
                return f.metadata["env"]
        raise TierMemError(f"tiermem: setting_name({name!r}): no such setting; this is a bug")

    def unused_settings(self) -> list:
        """``[(name, value)]``: settings set to other than their default that do nothing
        under this policy (``device_budget``, ``agree_ranks`` outside ``auto``; ``nvme_dir``,
        ``nvme_budget`` under a named policy without nvme), named as given."""
        tiers = None if self.policy is None or callable(self.policy) else self.policy.split(",")
        unused = [] if self.policy == "auto" else ["device_budget", "agree_ranks"]
        if tiers is not None and "auto" not in tiers and "nvme" not in tiers:
            unused += ["nvme_dir", "nvme_budget"]
        default = {f.name: f.default for f in dataclasses.fields(self)}
        return [(self.setting_name(n), getattr(self, n)) for n in unused
                if not self.disable and getattr(self, n) != default[n]]

    def warn_unused_settings(self) -> None:
        """Warn (``UserWarning``) of each :meth:`unused_settings`, once per process."""
        policy = ("a callable policy" if callable(self.policy) else "the default policy"
                  if self.policy is None else f"policy={self.policy!r}")
        for name, value in self.unused_settings():
            if (name, str(value), policy) not in _warned_unused:
                _warned_unused.add((name, str(value), policy))
                warnings.warn(f"tiermem: {name}={str(value)!r} has no effect under {policy}; "
                              "it is ignored", UserWarning, stacklevel=3)


# NOTE [Settings a policy ignores]
# A setting that does nothing under the chosen policy must not pass for one in
# force (``policy="cpu", device_budget="50%"``): device_budget and agree_ranks
# are read by the auto planner only; nvme_dir and nvme_budget only where the
# nvme tier may be used (a named policy without nvme makes no nvme store). A
# warning, not an error: a variable may be meant for another Offloader.
_warned_unused: set = set()


# NOTE [Setting names in messages]
# An error about a value names the setting the way the user gave it: a keyword
# argument by the argument (``nvme_dir='/x' is a file``), an environment
# variable by the variable (``TIERMEM_NVME_DIR='/x' is a file``), so that the
# user looks in the right place: their code or their launch script. Parsers
# are told the name by from_env. Checks made later, on the Config (the NVMe
# dir, when its store is made), ask Config.setting_name, which reads the set
# of settings that came from arguments, recorded by from_env and replace.
# That set is not a dataclass field: fields are the settings (the README's
# table, the doctor's listing and equality are derived from them), and two
# Configs of the same values are equal wherever the values came from.


# NOTE [Unknown variables]
# A misspelt variable (``TIERMEM_NVME_DRI``) would otherwise do nothing at all:
# the user believes tensors go to disk while every one stays on the device.
# So every ``TIERMEM_*`` name in the environment that is not a setting gets a
# ``UserWarning`` naming it and the closest setting, once per name per
# process (an Offloader per step must not repeat it). A warning, not an
# error: a variable left by another tiermem version must not stop training.
# Names under the prefixes of the project's own scripts (benchmarks, CI,
# tests) and the build's are not settings and are not warned about.
NON_SETTING_PREFIXES = ("TIERMEM_BENCH_", "TIERMEM_CI_", "TIERMEM_TEST_", "TIERMEM_SUITE_",
                        "TIERMEM_WITH_")
_warned_unknown: set = set()


def _warn_unknown_variables(environ: Mapping[str, str], settings: set) -> None:
    """Warn once per name about ``TIERMEM_*`` variables that are not settings
    (NOTE [Unknown variables])."""
    for name in environ:
        if (not name.startswith("TIERMEM_") or name in settings or name in _warned_unknown
                or name.startswith(NON_SETTING_PREFIXES)):
            continue
        _warned_unknown.add(name)
        close = difflib.get_close_matches(name, sorted(settings), n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]}?" if close else ""
        warnings.warn(f"tiermem: environment variable {name} is not a tiermem setting and is "
                      f"ignored{hint} (settings: {', '.join(sorted(settings))})",
                      UserWarning, stacklevel=3)


def _from_argument(f: dataclasses.Field, value: Any) -> Any:
    """Validate a keyword argument. Strings go through the variable's parser (so
    ``cpu_budget="8GiB"`` works); the message names the argument, not the variable."""
    name = f.name
    if name == "policy" and callable(value):
        return value
    if name == "policy" and isinstance(value, (list, tuple)):
        return _policy(",".join(str(getattr(v, "value", v)) for v in value), name)
    if isinstance(value, bool) and f.metadata["parse"] is _bool:
        return value
    if f.metadata["parse"] is _device_budget and isinstance(value, BudgetShare):
        if not 0 <= value.fraction <= 1:
            raise ConfigError(f"tiermem: {name}={value} must be from 0% to 100%")
        return value
    if isinstance(value, str):
        return _check_min(f, f.metadata["parse"](value, name), name, shown=value)
    if f.metadata["parse"] in (_size, _int, _device_budget) and isinstance(value, int) and not isinstance(value, bool):
        return _check_min(f, value, name)
    if name == "nvme_dir" and isinstance(value, os.PathLike):
        return _path(os.fspath(value), name)
    raise ConfigError(f"tiermem: {name}={value!r} has the wrong type ({type(value).__name__})")


def _check_min(f: dataclasses.Field, value: Any, name: str, shown: Any = None) -> Any:
    minimum, maximum = f.metadata["min"], f.metadata.get("max")
    if isinstance(value, BudgetShare):   # checked by its parser
        return value
    shown = value if shown is None else shown
    if minimum is not None and value < minimum:
        raise ConfigError(f"tiermem: {name}={shown!r} must be at least {minimum}")
    if maximum is not None and value > maximum:
        raise ConfigError(f"tiermem: {name}={shown!r} must be at most {maximum}")
    return value


def env_table_markdown() -> str:
    """The README's table of ``TIERMEM_*`` variables, generated from :class:`Config`."""
    rows = ["| variable | argument | default | meaning |", "| --- | --- | --- | --- |"]
    for f in dataclasses.fields(Config):
        m = f.metadata
        rows.append(f"| `{m['env']}` | `{f.name}` | {m['default_doc']} | {m['doc']} |")
    return "\n".join(rows)

"""The folders show the layers, and imports run downwards only: a module never
imports from a layer above its own, so a lower layer cannot call back into the
state of the one that drives it.

Layers, top first (a module's layer is that of its longest listed prefix):

0. the top level users touch: ``offloader``, ``attach``, ``blocks``,
   ``deciders``, ``demo``, ``doctor``, ``testing``, the CLI, ``integrations/``;
1. ``runtime.hooks``, ``runtime.keephooks`` (pack/unpack) -> 2. ``runtime.step`` -> 3.
   ``runtime.placement``;
4. ``tiers/`` and ``planner/`` (the planner reads what tiers hand back);
5. the rest of ``runtime/`` (prefetch, jobs, copier, leases, tail hold);
6. ``memory/``, ``tracking/``, ``io/``;
7. leaves every layer may use: ``config``, ``policy``, ``errors``,
   ``telemetry``, ``models``, ``_version``.
"""

import ast
import os

import pytest

PKG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tiermem")

LAYERS = {
    "offloader": 0, "attach": 0, "blocks": 0, "deciders": 0, "demo": 0, "doctor": 0,
    "oneshot": 0, "testing": 0,
    "__main__": 0, "__init__": 0, "integrations": 0,
    "runtime.hooks": 1, "runtime.keephooks": 1, "runtime.step": 2, "runtime.placement": 3,
    "tiers": 4, "planner": 4,
    "runtime": 5,
    "memory": 6, "tracking": 6, "io": 6,
    "config": 7, "policy": 7, "errors": 7, "telemetry": 7, "models": 7, "_version": 7,
}

#: Imports against the layers that are known and due to go, each with the work
#: that removes it. The list may only shrink.
KNOWN: set = set()


def _layer(module: str) -> int:
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        key = ".".join(parts[:n])
        if key in LAYERS:
            return LAYERS[key]
    raise AssertionError(f"tiermem/{module.replace('.', '/')}.py is in no layer: "
                         "add its folder to LAYERS in tests/test_layers.py")


def _imports(path: str, package: str):
    tree = ast.parse(open(path).read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:   # relative: resolve against the file's package
                parts = package.split(".") if package else []
                base = parts[: len(parts) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            elif (node.module or "").startswith("tiermem."):
                mod = node.module[len("tiermem."):]
            else:
                continue
            if not mod:      # `from . import x`: x is the module
                for alias in node.names:
                    yield node.lineno, alias.name
            else:
                yield node.lineno, mod
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("tiermem."):
                    yield node.lineno, alias.name[len("tiermem."):]


def _modules():
    for dirpath, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, f), PKG)[:-3].replace(os.sep, ".")
                if rel.endswith(".__init__"):
                    rel = rel[: -len(".__init__")]
                yield rel, os.path.join(dirpath, f)


def _package(mod: str, path: str) -> str:
    if path.endswith("__init__.py"):
        return "" if mod == "__init__" else mod
    return mod.rsplit(".", 1)[0] if "." in mod else ""


@pytest.mark.parametrize("folder", ["runtime", "tiers", "planner", "memory", "tracking", "io"])
def test_each_layer_folder_exists(folder):
    assert os.path.isfile(os.path.join(PKG, folder, "__init__.py"))


def test_every_module_is_in_a_layer():
    for mod, _ in _modules():
        _layer(mod)


#: The size a module of tiermem/ may reach (issue 29's bar): past it, split it
#: along a seam, as tiers/moving.py and tracking/producers.py were.
MAX_MODULE_LINES = 450


def test_every_module_is_at_most_450_lines():
    over = []
    for root, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(root, f)
                with open(path) as fh:
                    n = sum(1 for _ in fh)
                if n > MAX_MODULE_LINES:
                    over.append(f"{os.path.relpath(path, PKG)}: {n} lines")
    assert not over, f"modules over {MAX_MODULE_LINES} lines: {over}"


def test_no_module_imports_from_a_layer_above_it():
    bad = []
    for mod, path in _modules():
        here = _layer(mod)
        for line, target in _imports(path, _package(mod, path)):
            if _layer(target) < here and (mod, target.split(".")[0]) not in KNOWN:
                bad.append(f"tiermem/{mod.replace('.', '/')}.py:{line} imports {target}")
    assert not bad, "imports against the layers:\n" + "\n".join(bad)


def test_known_exceptions_still_exist():
    """An exception that is gone must leave the list (so it cannot return)."""
    seen = set()
    for mod, path in _modules():
        for _, target in _imports(path, _package(mod, path)):
            seen.add((mod, target.split(".")[0]))
    assert KNOWN <= seen, f"no longer imported, remove from KNOWN: {KNOWN - seen}"


def _names(path: str):
    """Every identifier of ``path``'s code: names, attributes, definitions,
    arguments and imported names (not comments, not strings)."""
    tree = ast.parse(open(path).read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            yield node.lineno, node.id
        elif isinstance(node, ast.Attribute):
            yield node.lineno, node.attr
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node.lineno, node.name
        elif isinstance(node, ast.arg):
            yield node.lineno, node.arg
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                yield node.lineno, alias.asname or alias.name


def test_the_runtime_and_the_tiers_never_import_or_name_the_planner():
    """runtime -> decider only (tiermem/deciders.py): the step path is given a
    decider and never reaches for the planner."""
    bad = []
    for mod, path in _modules():
        if not mod.startswith(("runtime", "tiers")):
            continue
        for line, target in _imports(path, _package(mod, path)):
            if target.split(".")[0] in ("planner", "deciders"):
                bad.append(f"tiermem/{mod.replace('.', '/')}.py:{line} imports {target}")
        for line, name in _names(path):
            if "planner" in name.lower():
                bad.append(f"tiermem/{mod.replace('.', '/')}.py:{line} names {name}")
    assert not bad, "the runtime reaches for the planner:\n" + "\n".join(bad)


# -- the per-step protocol (tiermem/deciders.py) ------------------------------------------

#: Where the runtime holds a step's decisions, and the names that object goes
#: by there: a ``StepDecider`` (``planning``, ``step_decider``) or the
#: Offloader's ``Decider`` (``decider``, ``_decider``).
PROTOCOL_USERS = ("runtime", "tiers", "offloader", "blocks")
HOLDER_NAMES = {"planning": "StepDecider", "step_decider": "StepDecider",
                "_step_decider": "StepDecider", "decider": "Decider", "_decider": "Decider"}


def _protocol_methods(name: str) -> set:
    import tiermem.deciders as deciders
    proto = getattr(deciders, name)
    return {n for n, v in vars(proto).items() if callable(v) and not n.startswith("_")}


def _holder(node):
    """The holder name ``node`` refers to (``planning``, ``self._step_decider``,
    ``ctx.planning``, ...), else None."""
    if isinstance(node, ast.Name):
        return node.id if node.id in HOLDER_NAMES else None
    if isinstance(node, ast.Attribute):
        return node.attr if node.attr in HOLDER_NAMES else None
    return None


def protocol_misuse(path: str, allowed: dict) -> list:
    """Each attribute of a decider (per HOLDER_NAMES) that ``path`` reads
    outside its protocol's methods (``allowed``: protocol name -> method
    names), and each attribute it writes or deletes."""
    bad = []
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if not isinstance(node, ast.Attribute):
            continue
        holder = _holder(node.value)
        if holder is None:
            continue
        if not isinstance(node.ctx, ast.Load):
            bad.append(f"{path}:{node.lineno} writes {holder}.{node.attr}")
        elif node.attr not in allowed[HOLDER_NAMES[holder]]:
            bad.append(f"{path}:{node.lineno} reads {holder}.{node.attr}, "
                       f"not a method of {HOLDER_NAMES[holder]}")
    return bad


def test_the_runtime_touches_a_decider_only_through_its_protocol():
    """runtime/, tiers/, offloader.py and blocks.py call the methods of the
    ``StepDecider`` and ``Decider`` protocols and read or write nothing else
    of them; no module outside the planner writes an attribute of one."""
    allowed = {n: _protocol_methods(n) for n in ("StepDecider", "Decider")}
    assert {"keep_at", "decide", "dedup_hit", "block"} <= allowed["StepDecider"]
    bad = []
    for mod, path in _modules():
        if mod.startswith("planner"):
            continue
        found = protocol_misuse(path, allowed)
        if not mod.startswith(PROTOCOL_USERS):
            found = [b for b in found if " writes " in b]
        bad += found
    assert not bad, "the per-step object touched outside its protocol:\n" + "\n".join(bad)


def test_the_scan_sees_field_reads_and_writes(tmp_path):
    """The scan above fails on what it forbids (the pack hook as it read the
    planner's fields before the protocol)."""
    src = tmp_path / "hook.py"
    src.write_text("def pack(self, t):\n"
                   "    planning = self.step.planning\n"
                   "    pos = planning.pos\n"
                   "    planning.pos = pos + 1\n"
                   "    self._step_decider.count += 1\n"
                   "    return planning.keep_at(t, 0)\n")
    allowed = {n: _protocol_methods(n) for n in ("StepDecider", "Decider")}
    bad = protocol_misuse(str(src), allowed)
    assert len(bad) == 3, bad   # planning.pos, and two writes


def test_the_planner_implements_the_protocols():
    """Every protocol method exists on the implementations, with the
    protocol's parameters."""
    import inspect

    from tiermem.deciders import PolicyDecider
    from tiermem.planner import Planner
    from tiermem.planner.runtime import StepPlanning
    for proto, impls in (("StepDecider", (StepPlanning,)), ("Decider", (Planner, PolicyDecider))):
        import tiermem.deciders as deciders
        for name in _protocol_methods(proto):
            want = list(inspect.signature(getattr(getattr(deciders, proto), name)).parameters)
            for cls in impls:
                have = list(inspect.signature(getattr(cls, name)).parameters)
                if isinstance(inspect.getattr_static(cls, name), staticmethod):
                    have = ["self"] + have
                assert have == want, f"{cls.__name__}.{name}{have} is not {proto}.{name}{want}"


def test_a_step_and_its_decider_do_not_hold_each_other():
    import gc

    import torch

    import tiermem
    off = tiermem.Offloader(policy="auto", device_budget="100%", min_offload_bytes=0)
    x0 = torch.randn(256, requires_grad=True)
    for _ in range(3):   # profiled, then planned
        with off as ctx:
            loss = torch.sin(torch.sin(x0 * 1.0)).sum()
        loss.backward()
    assert ctx.planning is not None

    def holds(a, b) -> bool:
        refs = gc.get_referents(a)
        return any(r is b for r in refs) or any(
            isinstance(r, dict) and any(v is b for v in r.values()) for r in refs)

    assert not holds(ctx.planning, ctx.step) and not holds(ctx.step, ctx.planning)
    off.close()

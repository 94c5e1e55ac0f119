"""The folders show the layers, and imports run downwards only: a module never
imports from a layer above its own, so a lower layer cannot call back into the
state of the one that drives it.

Layers, top first (a module's layer is that of its longest listed prefix):

0. the top level users touch: ``offloader``, ``attach``, ``blocks``,
   ``deciders``, ``demo``, ``doctor``, ``testing``, the CLI, ``integrations/``;
1. ``runtime.hooks`` (pack/unpack) -> 2. ``runtime.step`` -> 3.
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
    "runtime.hooks": 1, "runtime.step": 2, "runtime.placement": 3,
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

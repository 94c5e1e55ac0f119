"""Imports run one way along the step path (README "How it works"): no module
imports from a layer above it. Layers, top first:

offloader -> hooks -> step -> placement -> tiers/* and planner/* -> (jobs,
copier, leases, hostpool, arena, io, ...). The planner is consulted by
placement and reads what tiers hand back (a handle's kind), so it sits with
the tiers. A module of a lower layer importing a higher one
would let it call back into the hooks' or the step's state.
"""

import ast
import os

import pytest

PKG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tiermem")

#: Module -> layer (lower number: higher layer). Modules not listed are at the
#: bottom (helpers every layer may use).
LAYERS = {"offloader": 0, "hooks": 1, "step": 2, "placement": 3, "tiers": 4, "planner": 4}
BOTTOM = 5


def _layer(module: str) -> int:
    return LAYERS.get(module.split(".")[0], BOTTOM)


def _imports(path: str, package: str):
    tree = ast.parse(open(path).read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:   # relative: resolve against the file's package
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join([p for p in base if p] + ([node.module] if node.module else []))
            elif (node.module or "").startswith("tiermem."):
                mod = node.module[len("tiermem."):]
            else:
                continue
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
                yield rel, os.path.join(dirpath, f)


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_layer_exists(name):
    assert any(m == name or m.startswith(name + ".") for m, _ in _modules())


def test_no_module_imports_from_a_layer_above_it():
    bad = []
    for mod, path in _modules():
        if mod.startswith(("testing", "__main__", "__init__", "demo", "doctor")):
            continue   # entry points above the runtime
        package = mod.rsplit(".", 1)[0] if "." in mod else ""
        here = _layer(mod)
        for line, target in _imports(path, package):
            target = target.lstrip(".")
            if target and _layer(target) < here:
                bad.append(f"tiermem/{mod.replace('.', '/')}.py:{line} imports {target}")
    assert not bad, "imports against the step path:\n" + "\n".join(bad)

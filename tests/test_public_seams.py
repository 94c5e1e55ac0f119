"""Tests see tiermem through its public API and ``tiermem.testing`` only: no
test file reads a private attribute of a tiermem object or imports a private
name from tiermem, so that the runtime's inside can change without rewriting
the tests. torch's own private API (``torch._C``, ``torch.utils._pytree``, a
module's ``_forward_hooks``) is not tiermem's and stays allowed, and so do the
private helpers a test file defines for itself.

Where a test truly needs to look inside, add a small function to
``tiermem/testing/`` (its ``__all__``) named for what the test needs to know.
"""

import ast
import os
import re
import textwrap

HERE = os.path.dirname(os.path.abspath(__file__))

#: The test suite's own modules (helpers.py, models.py, ...): what they hand
#: out may be tiermem's, so names imported from them are not foreign.
LOCAL_MODULES = frozenset(f[:-3] for f in os.listdir(HERE)
                          if f.endswith(".py") and not f.startswith("test_"))

#: Private attributes of torch (and standard library) objects that tests read
#: on values whose type a scan cannot see: never tiermem's names.
FOREIGN_ATTRS = frozenset({
    "_forward_hooks", "_forward_pre_hooks", "_backward_hooks",   # nn.Module
    "_neg_view", "_version", "_base", "_cdata",                  # Tensor
    "_exit",                                                     # os
})

#: Private names of other projects' objects, by test file, that a scan cannot
#: tell from tiermem's: the benchmark suite's own method.
NOT_TIERMEM = {"test_bench_fit.py": frozenset({"_fit_interleaving"})}

_PRIVATE = re.compile(r"^_[A-Za-z0-9]\w*$")
_DUNDER = re.compile(r"^__\w+__$")
_TIERMEM_PATH = re.compile(r"^tiermem(\.\w+)+$")


def _private(name: str) -> bool:
    return bool(_PRIVATE.match(name)) and not _DUNDER.match(name)


def _tiermem_module(module: str) -> bool:
    return module == "tiermem" or module.startswith("tiermem.")


def _foreign_module(module: str) -> bool:
    top = module.split(".")[0]
    return bool(top) and top != "tiermem" and top not in LOCAL_MODULES


def _root(node):
    """The name an attribute chain starts from (``a`` of ``a.b().c[0].d``)."""
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def private_uses(source: str, filename: str = "<test>", allowed=frozenset()):
    """``(line, what)`` for each private tiermem name ``source`` reads or
    imports (``allowed``: private attribute names known not to be tiermem's)."""
    tree = ast.parse(source, filename)
    foreign, tiermem_names, own = set(), set(), set()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                bound = alias.asname or alias.name.split(".")[0]
                if _tiermem_module(alias.name):
                    tiermem_names.add(bound)
                elif _foreign_module(alias.name):
                    foreign.add(bound)
                if _tiermem_module(alias.name) and any(map(_private, alias.name.split("."))):
                    found.append((node.lineno, f"import {alias.name}"))
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            ours = _tiermem_module(module) and not node.level
            for alias in node.names:
                if ours:
                    tiermem_names.add(alias.asname or alias.name)
                elif _foreign_module(module) and not node.level:
                    foreign.add(alias.asname or alias.name)
                if ours and (any(map(_private, module.split("."))) or _private(alias.name)):
                    found.append((node.lineno, f"from {module} import {alias.name}"))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                own.add(node.attr)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            root = _root(node.value)
            if root in foreign:
                continue
            if root not in tiermem_names and (node.attr in own or node.attr in FOREIGN_ATTRS
                                              or node.attr in allowed):
                continue
            found.append((node.lineno, f".{node.attr}"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if _TIERMEM_PATH.match(node.value) and any(map(_private, node.value.split("."))):
                found.append((node.lineno, repr(node.value)))
        elif isinstance(node, ast.Call) and len(node.args) >= 2:
            name = node.args[1]
            if (isinstance(name, ast.Constant) and isinstance(name.value, str)
                    and _private(name.value) and _root(node.args[0]) not in foreign
                    and name.value not in own):
                found.append((node.lineno, repr(name.value)))
    return sorted(set(found))


def test_tests_use_public_seams_only():
    me = os.path.basename(__file__)
    bad = []
    for name in sorted(os.listdir(HERE)):
        if name.endswith(".py") and name != me:
            path = os.path.join(HERE, name)
            with open(path) as f:
                found = private_uses(f.read(), path, NOT_TIERMEM.get(name, frozenset()))
            bad += [f"tests/{name}:{line}: {what}" for line, what in found]
    assert not bad, ("tests read tiermem's private names (use the public API, or add a "
                     "function to tiermem/testing/):\n" + "\n".join(bad))


def _scan(snippet):
    return [what for _, what in private_uses(textwrap.dedent(snippet))]


def test_scanner_finds_private_reads_and_imports():
    assert sorted(_scan("""
        import tiermem
        from tiermem.tiers import moving
        from tiermem.tiers.recompute import _Node
        import tiermem._version
        from tiermem._version import __version__
        off = tiermem.Offloader()
        off._placement.stores
        moving._DYING.pop(1)
        tiermem.testing.planner_of(off)._profiles
        monkeypatch.setattr("tiermem.memory.cgroup._CGROUP_ROOT", "/")
        monkeypatch.setattr(moving.MovingStore, "_restore", None)
        getattr(off, "_decider")
        from helpers import offloader
        offloader("cpu")._tail
        from tiermem import _version as v

        class Mine(moving.MovingStore):
            def f(self):
                return self._unlaunched
    """)) == ["'_decider'", "'_restore'", "'tiermem.memory.cgroup._CGROUP_ROOT'", "._DYING",
              "._placement", "._profiles", "._tail", "._unlaunched",
              "from tiermem import _version", "from tiermem._version import __version__",
              "from tiermem.tiers.recompute import _Node", "import tiermem._version"]


def test_scanner_allows_torch_dunders_and_own_helpers():
    assert _scan("""
        import os
        import torch
        from torch.utils._pytree import tree_map
        from torch.utils import _python_dispatch
        from tiermem.__main__ import main
        from tiermem import oneshot as _one
        torch._C._len_torch_dispatch_stack()
        torch.cuda._sleep(10)
        _python_dispatch._get_current_dispatch_mode()
        model._forward_hooks
        os._exit(0)
        x.__class__.__name__

        class Slow:
            def __init__(self, f):
                self._f = f
            def _helper(self):
                return self._f.read()
        def _pinned(n):
            return n
        slow._f
        slow._helper()
        _pinned(3)
        setattr(slow, "_f", None)
        _one.Offloader
    """) == []

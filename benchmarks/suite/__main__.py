"""Entry point: ``python -m benchmarks.suite ...`` from the repository root, or
``python PATH/TO/benchmarks/suite ...`` (or ``.../suite/__main__.py``) from any
directory; the suite starts its child processes the second way.

Run as a script, Python puts this package's own directory first on sys.path,
where its modules (cli, machine, ...) would shadow top-level modules of the
same names: that entry is replaced by the repository root, which makes
``benchmarks.suite`` importable. Either way the root comes before
site-packages, so this checkout's ``tiermem`` is the one imported, in the
parent and in every child alike.
"""

import os
import sys

if not __package__:  # run as a script (a path), not with -m
    _here = os.path.dirname(os.path.realpath(__file__))
    _root = os.path.dirname(os.path.dirname(_here))
    if sys.path and os.path.realpath(sys.path[0] or os.curdir) == _here:
        sys.path[0] = _root
    else:
        sys.path.insert(0, _root)
    from benchmarks.suite.cli import main
else:
    from .cli import main

sys.exit(main())

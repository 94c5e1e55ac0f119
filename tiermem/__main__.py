"""Command line: ``python -m tiermem <command>`` (also installed as ``tiermem``).

Commands:

- ``demo``: train a small GPT a few steps with tiermem and check that the
  gradients are bit-identical to plain autograd (exit 1 if not).
- ``doctor``: engine, RAM, GPU, NVMe dir checks and bandwidth.
- ``build``: prebuild the C++ I/O engine.
- ``env-table``: print the Markdown table of ``TIERMEM_*`` variables.

Adding a command: write ``_add_<name>(subparsers)`` that creates its parser
and sets ``handler`` (a function ``(args) -> exit status``), and list it in
``_COMMANDS``. Heavy work (building models, benchmarks, compiling) belongs in
the handler, not in ``_add_<name>``, which runs for every command.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import sys
import traceback
from typing import Callable, Optional, Sequence


def _use_this_package() -> None:
    """Make ``tiermem`` this package when it was imported as a namespace package.

    ``python -m tiermem`` from the directory that holds a source checkout named
    ``tiermem`` (no ``__init__.py`` at its top) with an editable install: the
    path finder takes that folder for a namespace package before the editable
    install's finder is asked, and ``tiermem.__version__`` and the package's
    other names are missing. This module's own folder is the real package."""
    pkg = sys.modules.get(__package__ or "")
    if pkg is None or getattr(pkg, "__file__", None) is not None:
        return
    here = os.path.dirname(os.path.abspath(__file__))
    spec = importlib.util.spec_from_file_location(
        __package__, os.path.join(here, "__init__.py"), submodule_search_locations=[here])
    real = importlib.util.module_from_spec(spec)
    sys.modules[__package__] = real
    spec.loader.exec_module(real)


_use_this_package()

from ._version import __version__  # noqa: E402  (after the package is the real one)
from .errors import ConfigError, TierMemError  # noqa: E402

__all__ = ["main", "build_parser"]


def _add_demo(sub) -> None:
    from . import demo

    p = sub.add_parser(
        "demo", help="train a tiny GPT with tiermem and check gradients bit-for-bit",
        description=demo.__doc__.split("\n\n")[0].strip().replace("``", ""))
    demo.add_arguments(p)

    def handler(args: argparse.Namespace) -> int:
        return demo.run(args)
    p.set_defaults(handler=handler)


def _add_env_table(sub) -> None:
    p = sub.add_parser(
        "env-table", help="print the table of TIERMEM_* variables (Markdown)",
        description="Print every tiermem setting as a Markdown table: its TIERMEM_* "
        "variable, the Offloader argument of the same name, the default and what it does. "
        "Keyword arguments override variables, which override defaults.")

    def handler(args: argparse.Namespace) -> int:
        from .config import env_table_markdown
        print(env_table_markdown())
        return 0
    p.set_defaults(handler=handler)


def _add_doctor(sub) -> None:
    from . import doctor
    p = sub.add_parser("doctor", help="what tiermem will use here (engine, RAM, GPU, NVMe dir "
                       "bandwidth): the first thing to run",
                       description="Report what tiermem will use on this machine, and how "
                       "fast: the settings in effect, the I/O engine and why, RAM and the default "
                       "budgets, the GPU, and for the NVMe directory (--dir or TIERMEM_NVME_DIR) "
                       "its free space, whether O_DIRECT works and its write and read bandwidth. "
                       "Exit status 1 when the NVMe directory fails its checks.")
    doctor.add_arguments(p)
    p.set_defaults(handler=doctor.run)


def _add_build(sub) -> None:
    p = sub.add_parser(
        "build", help="build the C++ I/O engine now (otherwise built on first use)",
        description="Compile the C++ I/O engine of the NVMe tier (or find it up to date) and "
        "print the path of the built module and whether it moves CUDA tensors itself. "
        "An install that compiled the engine needs no build; otherwise tiermem builds it "
        "on first use (about a minute, once per torch version and source) and says so.")

    def handler(args: argparse.Namespace) -> int:
        from .io.build import build
        from .io.cpp import cuda_status
        print(build(verbose=True))
        cuda, why = cuda_status()
        print(f"CUDA chain: {'yes' if cuda else 'no'} ({why})")
        return 0
    p.set_defaults(handler=handler)


#: Registered commands, in the order ``--help`` lists them. Future: bench.
_COMMANDS: Sequence[Callable] = (_add_demo, _add_doctor, _add_build, _add_env_table)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tiermem",
        description="tiermem: per-tensor activation offloading for PyTorch training.")
    parser.add_argument("--version", action="version", version=f"tiermem {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="log the tiermem logger at INFO level")
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    sub.required = True
    for add in _COMMANDS:
        add(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the command, return its exit status."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.verbose:
        logging.getLogger("tiermem").setLevel(logging.INFO)
    try:
        return int(args.handler(args) or 0)
    except (TierMemError, ConfigError) as e:
        # A message for the user (the traceback with -v): exit 2 for a bad
        # setting, like argparse's usage errors, 1 for a failure at run time.
        if args.verbose:
            traceback.print_exc()
        else:
            print(f"{e}", file=sys.stderr)
        return 2 if isinstance(e, ConfigError) else 1
    except BrokenPipeError:  # e.g. `python -m tiermem env-table | head`
        sys.stdout = None  # nothing more can be written; keep interpreter exit quiet
        return 0


if __name__ == "__main__":
    sys.exit(main())

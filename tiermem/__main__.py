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
import logging
import sys
import traceback
from typing import Callable, Optional, Sequence

from ._version import __version__
from .errors import ConfigError, TierMemError

__all__ = ["main", "build_parser"]


def _add_demo(sub) -> None:
    from . import demo

    p = sub.add_parser(
        "demo", help="train a tiny GPT with tiermem and check gradients bit-for-bit",
        description=demo.__doc__.split("\n\n")[0].strip())
    demo.add_arguments(p)

    def handler(args: argparse.Namespace) -> int:
        return demo.run(args)
    p.set_defaults(handler=handler)


def _add_env_table(sub) -> None:
    p = sub.add_parser("env-table", help="print the table of TIERMEM_* variables (Markdown)")

    def handler(args: argparse.Namespace) -> int:
        from .config import env_table_markdown
        print(env_table_markdown())
        return 0
    p.set_defaults(handler=handler)


def _add_doctor(sub) -> None:
    from . import doctor
    p = sub.add_parser("doctor", help="what tiermem will use here (engine, RAM, GPU, NVMe dir "
                       "bandwidth): the first thing to run")
    doctor.add_arguments(p)
    p.set_defaults(handler=doctor.run)


def _add_build(sub) -> None:
    p = sub.add_parser("build", help="prebuild the C++ I/O engine (otherwise built on first use)")

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

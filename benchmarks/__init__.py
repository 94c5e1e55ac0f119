"""The benchmarks. A package so that ``python -m benchmarks.suite`` (the
side-by-side suite, ``benchmarks/suite/``) finds its siblings ``common``,
``models_bench`` and ``plots``; a regular package rather than a namespace one,
so that no installed distribution's top-level ``benchmarks`` can take its
place. The ``bench_*.py`` scripts and ``plots.py`` still run as scripts
(``python benchmarks/bench_step.py``) and import ``common`` from their own
directory."""

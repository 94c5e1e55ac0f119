"""Package discovery for tiermem (the rest of the metadata is in pyproject.toml).

Every package under ``tiermem/`` is found, never listed by hand; the C++
engine's sources (top-level ``csrc/``) ship inside the wheel as
``tiermem._csrc``, where ``tiermem/io/cpp.py`` finds them outside a checkout.
"""

from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["tiermem", "tiermem.*"]) + ["tiermem._csrc"],
    package_dir={"tiermem._csrc": "csrc"},
)

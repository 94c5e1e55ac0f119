"""Packages and the compiled engine of tiermem (the rest of the metadata is in pyproject.toml).

Every package under ``tiermem/`` is found, never listed by hand; the C++
engine's sources (top-level ``csrc/``) ship inside the wheel as
``tiermem._csrc``, where ``tiermem/io/cpp.py`` finds them outside a checkout.

The engine is compiled here as ``tiermem._C`` (torch's ``BuildExtension``;
with a CUDA build of torch and a CUDA toolkit, with the CUDA chain) and
stamped with the torch version and the sources' hash (NOTE [Engine build
identity] in tiermem/io/buildkey.py). Where torch is not importable in the
build environment (pip's build isolation, which also pulls another torch:
install with ``--no-build-isolation``), no compiler is found, or the compile
fails, the install goes on without it, saying why, and tiermem builds the
engine on first use instead.
"""

import importlib.util
import os
import shutil
import sys

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))


def _say(text: str) -> None:
    print(f"tiermem setup: {text}", file=sys.stderr, flush=True)


def _buildkey():
    """tiermem/io/buildkey.py, loaded by path (standard library only)."""
    spec = importlib.util.spec_from_file_location(
        "_tiermem_buildkey", os.path.join(HERE, "tiermem", "io", "buildkey.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _engine():
    """``(ext_modules, cmdclass)`` building tiermem._C, or ``([], {})`` and why not."""
    later = "; the C++ I/O engine will be built on first use instead"
    if os.environ.get("TIERMEM_WITH_ENGINE", "1").strip().lower() in ("0", "false", "off", "no"):
        _say("TIERMEM_WITH_ENGINE=0: not compiling the C++ I/O engine" + later)
        return [], {}
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError as e:
        _say(f"torch is not importable here ({e}): not compiling the C++ I/O engine (install "
             "torch first and use pip's --no-build-isolation)" + later)
        return [], {}
    compiler = os.environ.get("CXX", "c++").split()[0]
    if shutil.which(compiler) is None:
        _say(f"no C++ compiler ({compiler!r} is not on PATH): not compiling the C++ I/O "
             "engine" + later)
        return [], {}
    bk = _buildkey()
    cuda = torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None
    if torch.version.cuda is None:
        note = "torch is a CPU-only build"
    elif cuda:
        note = f"CUDA {torch.version.cuda}, toolkit {cpp_extension.CUDA_HOME}"
    else:
        note = "no CUDA toolkit was found at install (set CUDA_HOME and reinstall)"
    sources, _, cflags = bk.variant("csrc", cuda)
    make = cpp_extension.CUDAExtension if cuda else cpp_extension.CppExtension
    ext = make(bk.PREBUILT_MODULE, sources, include_dirs=[os.path.join(HERE, "csrc")],
               extra_compile_args={"cxx": cflags, "nvcc": []} if cuda else cflags)
    ext.optional = True   # a failed compile leaves nothing to copy, and that is fine
    stamp = bk.make_stamp(torch.__version__, cuda, bk.variant_sha256(
        os.path.join(HERE, "csrc"), cuda), note)

    class BuildEngine(cpp_extension.BuildExtension):
        """Compile the engine, stamp it; a failure leaves the install without it."""

        def build_extension(self, extension):
            if cuda and not os.environ.get("TORCH_CUDA_ARCH_LIST"):
                os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0"   # .cpp only: no device code
            _say(f"compiling the C++ I/O engine ({note}; about a minute)")
            try:
                super().build_extension(extension)
            except Exception as e:   # noqa: BLE001 - reported, and the JIT build remains
                _say(f"compiling the C++ I/O engine failed ({type(e).__name__}: "
                     f"{str(e)[-2000:]})" + later)
                return
            self.stamp_path = os.path.join(
                os.path.dirname(self.get_ext_fullpath(extension.name)), bk.PREBUILT_STAMP)
            bk.write_stamp(self.stamp_path, stamp)

        def copy_extensions_to_source(self):
            """In-place builds (editable installs): the stamp goes with the module."""
            super().copy_extensions_to_source()
            if getattr(self, "stamp_path", None):
                shutil.copyfile(self.stamp_path, os.path.join(
                    os.path.dirname(self.get_ext_fullpath(bk.PREBUILT_MODULE)),
                    bk.PREBUILT_STAMP))

    return [ext], {"build_ext": BuildEngine.with_options(use_ninja=True)}


ext_modules, cmdclass = _engine()

setup(
    packages=find_packages(include=["tiermem", "tiermem.*"]) + ["tiermem._csrc"],
    package_dir={"tiermem._csrc": "csrc"},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)

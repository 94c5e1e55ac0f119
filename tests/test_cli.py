"""The command line (``python -m tiermem`` / ``tiermem``): options are checked,
every command explains itself, and doctor leaves the machine as it found it."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tiermem.__main__ import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env():
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERMEM_")}
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in env.get("PYTHONPATH", "").split(
        os.pathsep) if p])
    return env


def _help(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as e:
        main([*argv, "--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("mib", ["-5", "0", "1.5"])
def test_doctor_rejects_a_bandwidth_size_that_is_not_a_positive_whole_mib(capsys, mib):
    with pytest.raises(SystemExit) as e:
        main(["doctor", "--mib", mib])
    assert e.value.code == 2
    assert "argument --mib" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["demo", "doctor", "build", "env-table"])
def test_every_command_help_has_a_description(capsys, command):
    text = _help(capsys, command)
    # usage, then a description paragraph, then the options
    before_options = text.split("options:")[0].strip().split("\n\n")
    assert len(before_options) >= 2 and len(before_options[1]) > 40, text
    assert "``" not in text   # no reST markup in what a user reads


def test_demo_help_lists_the_policies_readably(capsys):
    text = " ".join(_help(capsys, "demo").split())
    assert "{keep," not in text
    assert "--policy POLICY" in text
    assert "keep, cpu, nvme, recompute, recompute,cpu, recompute,nvme, auto" in text


def test_demo_of_one_step_says_one_step(capsys):
    assert main(["demo", "--steps", "1", "--policy", "keep", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "in the one step" in out and "1 steps" not in out


@pytest.mark.slow
def test_doctor_removes_the_directories_it_created_for_the_check(tmp_path):
    target = tmp_path / "missing" / "deep" / "dir"
    r = subprocess.run([sys.executable, "-m", "tiermem", "doctor", "--dir", str(target),
                        "--mib", "1", "--json"], capture_output=True, text=True, env=_env(),
                       timeout=300)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["nvme"]["bandwidth"]["bytes"] == 1 << 20
    assert report["nvme"]["created_and_removed"] is True
    assert list(tmp_path.iterdir()) == []


# What an editable install does (setuptools' finder, asked after the path
# finder), with the working directory holding a checkout named ``tiermem``:
# ``import tiermem`` finds that folder first, as a namespace package.
_NAMESPACE_RUN = textwrap.dedent("""
    import importlib.util, os, runpy, sys
    root, parent = sys.argv[1], sys.argv[2]
    sys.path[:] = [parent] + [p for p in sys.path if os.path.abspath(p or ".") != root]

    class Editable:
        @staticmethod
        def find_spec(name, path=None, target=None):
            if name != "tiermem" and not name.startswith("tiermem."):
                return None
            base = os.path.join(root, *name.split("."))
            if os.path.isdir(base):
                return importlib.util.spec_from_file_location(
                    name, os.path.join(base, "__init__.py"), submodule_search_locations=[base])
            if os.path.isfile(base + ".py"):
                return importlib.util.spec_from_file_location(name, base + ".py")
            return None

    sys.meta_path[:] = [f for f in sys.meta_path   # this tree's, not another install's
                        if "__editable__" not in getattr(f, "__module__", "")] + [Editable]
    import tiermem
    assert getattr(tiermem, "__file__", None) is None, "not a namespace package"
    del sys.modules["tiermem"]
    sys.argv = ["tiermem", "doctor", "--json"]
    runpy.run_module("tiermem", run_name="__main__", alter_sys=True)
""")


@pytest.mark.slow
def test_python_m_tiermem_works_from_the_folder_holding_the_checkout(tmp_path):
    from tiermem import __version__
    os.symlink(ROOT, tmp_path / "tiermem")
    env = _env()
    env.pop("PYTHONPATH")
    r = subprocess.run([sys.executable, "-c", _NAMESPACE_RUN, ROOT, str(tmp_path)],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["tiermem"] == __version__

"""`python -m tiermem doctor` and `build` run and report what they promise."""

import json
import os
import subprocess
import sys

import pytest

import tiermem.testing


def _run(*args, env_extra=None):
    import os
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERMEM_")}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "tiermem", *args], capture_output=True,
                          text=True, env=env, timeout=300)


@pytest.mark.slow
def test_doctor_measures_the_nvme_dir(tmp_path):
    r = _run("doctor", "--dir", str(tmp_path), "--mib", "8", "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    nv = report["nvme"]
    assert nv["o_direct"] in ("yes",) or nv["o_direct"].startswith("no (")
    assert nv["bandwidth"]["bytes"] == 8 << 20
    assert nv["bandwidth"]["write_GBps"] > 0 and nv["bandwidth"]["read_GBps"] > 0
    assert report["engine"]["engine"] in ("cpp", "python")
    assert list(tmp_path.iterdir()) == []      # nothing left behind


def test_doctor_reports_a_bad_dir_and_fails(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    r = _run("doctor", "--dir", str(f), "--mib", "1")
    assert r.returncode == 1
    assert "is a file, not a directory" in r.stdout


@pytest.mark.slow
def test_doctor_without_dir_still_reports():
    r = _run("doctor")
    assert r.returncode == 0, r.stderr
    assert "I/O engine:" in r.stdout and "NVMe dir: not set" in r.stdout


def test_o_direct_probe_answers_as_the_engines_and_leaves_no_file(tmp_path):
    """ramfs creates the file, then refuses O_DIRECT: 'no', and the probe file
    is gone; the doctor and the engine say the same thing."""
    from helpers import mounted

    from tiermem.io import get_engine

    with mounted(tmp_path / "ramfs", "ramfs", "mode=0700") as where:
        assert tiermem.testing.o_direct_answer(str(where)).startswith("no (")
        assert os.listdir(where) == []
        engine = get_engine("python", 1)
        f = engine.open(str(where / "data"), 4096)
        assert f.direct is False
        f.close()
        engine.close()
    disk = tmp_path / "disk"
    disk.mkdir()
    answer = tiermem.testing.o_direct_answer(str(disk))
    engine = get_engine("python", 1)
    f = engine.open(str(disk / "data"), 4096)
    assert answer == ("yes" if f.direct else "no (an aligned O_DIRECT write was refused)")
    f.close()
    engine.close()
    assert os.listdir(disk) == ["data"]


@pytest.mark.slow
def test_build_prints_the_extension_and_whether_it_has_the_cuda_chain():
    from tiermem.io import engine_info
    if engine_info()["engine"] != "cpp":
        # The same failure `build` must report: it exits non-zero with the reason.
        r = _run("build")
        assert r.returncode != 0 and r.stderr.strip()
        return
    r = _run("build")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert any(line.endswith(".so") and os.path.isfile(line) for line in lines), r.stdout
    assert any(line.startswith("CUDA chain: ") for line in lines), r.stdout


@pytest.mark.slow
def test_a_bad_setting_is_one_line_on_stderr_and_exit_2():
    r = _run("demo", "--steps", "1", "--no-progress", env_extra={"TIERMEM_ENGINE": "rust"})
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert r.stderr.strip().splitlines() == [
        "tiermem: TIERMEM_ENGINE='rust' is not valid; choose one of auto, cpp, python"], r.stderr

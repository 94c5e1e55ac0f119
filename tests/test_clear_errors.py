"""Bad input and misuse get a clear error naming the setting and the value
(issue 14 #11)."""

import os
import subprocess
import sys

import pytest
import torch

import tiermem
from tiermem.config import parse_size


@pytest.mark.parametrize("policy", ["cpu", "nvme", "keep"])
def test_a_closed_offloader_refuses_a_new_step_on_every_tier(tmp_path, policy):
    off = tiermem.Offloader(policy=policy, nvme_dir=str(tmp_path))
    off.close()
    x = torch.randn(1 << 14, requires_grad=True)
    with pytest.raises(tiermem.TierMemError, match="was closed"):
        with off:
            x.sin()


def test_offload_replaces_an_offloader_its_user_closed():
    a = tiermem.offload(policy="cpu")
    a.close()
    b = tiermem.offload(policy="cpu")
    assert b is not a and not b.closed


@pytest.mark.parametrize("text", ["١٢٣", "1.5", "0.3B", "1.0001KiB"])
def test_sizes_are_ascii_digits_and_whole_bytes(text):
    with pytest.raises(tiermem.ConfigError, match="TIERMEM_CPU_BUDGET"):
        parse_size(text, name="TIERMEM_CPU_BUDGET")


def test_fractional_sizes_with_a_unit_that_make_whole_bytes_still_parse():
    assert parse_size("1.5KiB", name="x") == 1536 and parse_size("0.5kB", name="x") == 500


def test_a_dangling_symlink_as_nvme_dir_says_so(tmp_path):
    link = tmp_path / "scratch"
    os.symlink(tmp_path / "gone", link)
    with pytest.raises(tiermem.ConfigError, match="symbolic link .* does not exist"):
        tiermem.Offloader(policy="nvme", nvme_dir=str(link))


def test_a_pseudo_filesystem_as_nvme_dir_is_a_config_error():
    if not os.path.isdir("/proc/self"):
        pytest.skip("no /proc here")
    with pytest.raises(tiermem.ConfigError, match="cannot create files there"):
        tiermem.Offloader(policy="nvme", nvme_dir="/proc")


def test_doctor_on_a_pseudo_filesystem_names_the_problem():
    if not os.path.isdir("/proc/self"):
        pytest.skip("no /proc here")
    out = subprocess.run([sys.executable, "-m", "tiermem", "doctor", "--dir", "/proc", "--mib", "1"],
                         capture_output=True, text=True, timeout=120)
    assert "cannot create files there" in out.stdout + out.stderr
    assert "FileNotFoundError" not in out.stdout + out.stderr


def test_a_callable_policy_may_answer_a_preference_list_as_a_string():
    x = torch.randn(1 << 14, requires_grad=True)
    x.sin().cos().sum().backward()
    ref, x.grad = x.grad.clone(), None
    off = tiermem.Offloader(policy=lambda info: "recompute,cpu", min_offload_bytes=0)
    with off:
        y = x.sin().cos()
    y.sum().backward()
    assert torch.equal(x.grad, ref)
    assert off.stats.count_by_tier["recompute"] + off.stats.count_by_tier["cpu"] > 0
    off.close()


def test_demo_takes_the_policy_from_the_environment(monkeypatch, tmp_path):
    env = dict(os.environ, TIERMEM_POLICY="nvme", TIERMEM_NVME_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-m", "tiermem", "demo", "--steps", "1", "--no-progress"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    assert "policy nvme" in out.stdout


def test_demo_nvme_without_a_dir_is_a_clear_error(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERMEM_")}
    out = subprocess.run([sys.executable, "-m", "tiermem", "demo", "--policy", "nvme", "--steps", "1"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 2 and "TIERMEM_NVME_DIR" in out.stderr


def test_a_step_that_fails_to_start_leaves_the_offloader_usable(monkeypatch):
    """A failure while a step is set up (before the forward runs) must not
    leave the Offloader marked active: the next ``with`` enters it."""
    import torch
    import tiermem.offloader as offloader_mod
    off = tiermem.Offloader(policy="keep")
    real = offloader_mod.OffloadContext
    calls = []

    def failing(o):
        calls.append(o)
        if len(calls) == 1:
            raise tiermem.ConfigError("tiermem: made up setup failure")
        return real(o)

    monkeypatch.setattr(offloader_mod, "OffloadContext", failing)
    with pytest.raises(tiermem.ConfigError, match="made up"):
        with off:
            pass
    x = torch.randn(4, 4, requires_grad=True)
    with off:
        y = (x * x).sum()
    y.backward()
    assert torch.equal(x.grad, 2 * x.detach())
    off.close()


@pytest.fixture
def a_file(tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    return str(f)


def test_a_bad_nvme_dir_given_as_an_argument_is_named_by_the_argument(a_file, monkeypatch):
    """NOTE [Setting names in messages]: the user looks in their code, not
    their environment."""
    monkeypatch.delenv("TIERMEM_NVME_DIR", raising=False)
    with pytest.raises(tiermem.ConfigError) as e:
        tiermem.Offloader(policy="nvme", nvme_dir=a_file)
    assert f"nvme_dir={a_file!r} is a file" in str(e.value)
    assert "TIERMEM_NVME_DIR" not in str(e.value)


@pytest.mark.parametrize("make", ["Offloader", "offload"])
def test_a_bad_nvme_dir_from_the_environment_is_named_by_the_variable(a_file, monkeypatch,
                                                                      make):
    monkeypatch.setenv("TIERMEM_NVME_DIR", a_file)
    with pytest.raises(tiermem.ConfigError, match=f"TIERMEM_NVME_DIR={a_file!r} is a file"):
        getattr(tiermem, make)(policy="nvme")


@pytest.mark.parametrize("given_as", ["argument", "environment"])
def test_an_nvme_dir_without_room_for_the_private_dir_is_named_as_given(
        tmp_path, monkeypatch, given_as):
    import errno
    from tiermem.tiers import nvme

    def refuse(root):
        raise PermissionError(errno.EACCES, "Permission denied", root)
    monkeypatch.setattr(nvme, "PrivateDir", refuse)
    if given_as == "argument":
        monkeypatch.delenv("TIERMEM_NVME_DIR", raising=False)
        settings, name = {"nvme_dir": str(tmp_path)}, "nvme_dir"
    else:
        monkeypatch.setenv("TIERMEM_NVME_DIR", str(tmp_path))
        settings, name = {}, "TIERMEM_NVME_DIR"
    with pytest.raises(tiermem.ConfigError, match="cannot create tiermem's private") as e:
        tiermem.Offloader(policy="nvme", engine="python", **settings)
    assert str(e.value).startswith(f"tiermem: {name}={str(tmp_path)!r}:")


def test_a_null_byte_in_nvme_dir_is_a_config_error_naming_the_setting():
    with pytest.raises(tiermem.ConfigError, match="null byte") as e:
        tiermem.Offloader(policy="nvme", nvme_dir="\x00bad")
    assert "nvme_dir='\\x00bad'" in str(e.value)


def test_checking_an_nvme_dir_with_a_null_byte_is_a_config_error():
    from tiermem.memory.spilldir import check_nvme_dir
    with pytest.raises(tiermem.ConfigError, match=r"--dir='/x\\x00y' contains a null byte"):
        check_nvme_dir("/x\x00y", "--dir")

"""Config: every TIERMEM_* variable parsed, bad values named, precedence, docs table."""

import dataclasses
import pathlib
import re

import pytest
import torch

import tiermem
import tiermem.testing
from tiermem import Config, ConfigError
from tiermem.config import parse_bool, parse_size

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("text,expected", [
    ("4096", 4096), ("0", 0), ("512MiB", 512 * 2**20), ("16GB", 16 * 10**9),
    ("1k", 1000), ("2KiB", 2048), ("1.5GiB", int(1.5 * 2**30)), (" 64 kib ", 64 * 1024),
    ("3b", 3),
])
def test_parse_size_accepts_bytes_and_suffixes(text, expected):
    assert parse_size(text, name="X") == expected


@pytest.mark.parametrize("text", ["abc", "", "12XB", "-5", "1e9", "MiB"])
def test_parse_size_rejects_garbage_naming_the_setting(text):
    with pytest.raises(ConfigError, match=re.escape(f"X={text!r}")):
        parse_size(text, name="X")


@pytest.mark.parametrize("text,expected", [
    ("1", True), ("true", True), ("ON", True), ("yes", True),
    ("0", False), ("False", False), ("off", False), ("no", False),
])
def test_parse_bool(text, expected):
    assert parse_bool(text, name="X") is expected


def test_parse_bool_rejects_other_words():
    with pytest.raises(ConfigError, match="TIERMEM_VERIFY='maybe'"):
        parse_bool("maybe", name="TIERMEM_VERIFY")


# One good value per variable and the field value it must give.
GOOD = {
    "TIERMEM_POLICY": ("CPU", "policy", "cpu"),
    "TIERMEM_NVME_DIR": ("/tmp/tm-nvme", "nvme_dir", "/tmp/tm-nvme"),
    "TIERMEM_MIN_OFFLOAD_BYTES": ("1MiB", "min_offload_bytes", 2**20),
    "TIERMEM_CPU_BUDGET": ("8GiB", "cpu_budget", 8 * 2**30),
    "TIERMEM_NVME_BUDGET": ("100GB", "nvme_budget", 100 * 10**9),
    "TIERMEM_PREFETCH_BYTES": ("64MiB", "prefetch_bytes", 64 * 2**20),
    "TIERMEM_TAIL_HOLD_BYTES": ("8MiB", "tail_hold_bytes", 8 * 2**20),
    "TIERMEM_DEVICE_BUDGET": ("12GiB", "device_budget", 12 * 2**30),
    "TIERMEM_AGREE_RANKS": ("no", "agree_ranks", False),
    "TIERMEM_ENGINE": ("python", "engine", "python"),
    "TIERMEM_IO_THREADS": ("8", "io_threads", 8),
    "TIERMEM_VERIFY": ("yes", "verify", True),
    "TIERMEM_CHECK_PARAMS": ("off", "check_params", False),
    "TIERMEM_DISABLE": ("1", "disable", True),
    "TIERMEM_LOG": ("DEBUG", "log", "debug"),
}

BAD = {
    "TIERMEM_POLICY": "fast",
    "TIERMEM_MIN_OFFLOAD_BYTES": "abc",
    "TIERMEM_CPU_BUDGET": "lots",
    "TIERMEM_NVME_BUDGET": "-1",
    "TIERMEM_PREFETCH_BYTES": "many",
    "TIERMEM_TAIL_HOLD_BYTES": "-1",
    "TIERMEM_DEVICE_BUDGET": "150%",
    "TIERMEM_AGREE_RANKS": "all",
    "TIERMEM_ENGINE": "rust",
    "TIERMEM_IO_THREADS": "0",
    "TIERMEM_VERIFY": "perhaps",
    "TIERMEM_CHECK_PARAMS": "sometimes",
    "TIERMEM_DISABLE": "2",
    "TIERMEM_LOG": "loud",
}


def test_every_field_has_a_variable_and_test_values():
    envs = {f.metadata["env"] for f in dataclasses.fields(Config)}
    # TIERMEM_NVME_DIR takes any path; the NVMe tier checks the directory itself.
    assert envs == set(GOOD) == set(BAD) | {"TIERMEM_NVME_DIR"}


@pytest.mark.parametrize("env", sorted(GOOD))
def test_each_variable_is_read(env):
    text, field, expected = GOOD[env]
    assert getattr(Config.from_env({env: text}), field) == expected


@pytest.mark.parametrize("env", sorted(BAD))
def test_each_bad_value_names_variable_and_value(env):
    with pytest.raises(ConfigError) as err:
        Config.from_env({env: BAD[env]})
    assert f"{env}={BAD[env]!r}" in str(err.value)
    assert str(err.value).startswith("tiermem:")


def test_unknown_policy_lists_the_valid_ones():
    with pytest.raises(ConfigError) as err:
        Config.from_env({"TIERMEM_POLICY": "fast"})
    for name in ("keep", "cpu", "nvme", "recompute", "auto"):
        assert name in str(err.value)


def test_defaults_without_environment():
    cfg = Config.from_env({})
    assert cfg.policy is None and cfg.nvme_dir is None and cfg.cpu_budget is None
    assert cfg.min_offload_bytes == 64 * 1024
    assert cfg.prefetch_bytes is None   # auto: sized from the bytes moved
    assert cfg.engine == "auto" and cfg.disable is False


def test_empty_variable_counts_as_unset():
    assert Config.from_env({"TIERMEM_MIN_OFFLOAD_BYTES": ""}).min_offload_bytes == 64 * 1024


def test_argument_beats_environment_beats_default():
    env = {"TIERMEM_MIN_OFFLOAD_BYTES": "1KiB", "TIERMEM_POLICY": "keep"}
    cfg = Config.from_env(env, min_offload_bytes=7)
    assert cfg.min_offload_bytes == 7          # argument
    assert cfg.policy == "keep"                # environment
    assert cfg.prefetch_bytes is None          # default (auto)


def test_arguments_accept_size_strings_and_name_the_argument():
    assert Config.from_env({}, cpu_budget="2GiB").cpu_budget == 2 * 2**30
    with pytest.raises(ConfigError, match="cpu_budget='x'"):
        Config.from_env({}, cpu_budget="x")
    with pytest.raises(ConfigError, match="min_offload_bytes=-1"):
        Config.from_env({}, min_offload_bytes=-1)
    with pytest.raises(ConfigError, match="prefetch_bytes=1.5"):
        Config.from_env({}, prefetch_bytes=1.5)


def test_unknown_argument_is_rejected_with_valid_names():
    with pytest.raises(ConfigError, match="min_offload_byte") as err:
        tiermem.Offloader(min_offload_byte=5)
    assert "min_offload_bytes" in str(err.value)


def test_offloader_reads_environment(monkeypatch):
    monkeypatch.setenv("TIERMEM_MIN_OFFLOAD_BYTES", "abc")
    with pytest.raises(ConfigError, match="TIERMEM_MIN_OFFLOAD_BYTES='abc'"):
        tiermem.Offloader()


def test_offloader_argument_overrides_bad_environment(monkeypatch):
    monkeypatch.setenv("TIERMEM_POLICY", "fast")
    assert tiermem.Offloader(policy="keep").config.policy == "keep"


def test_callable_policy_is_accepted_as_argument():
    fn = lambda info: "keep"  # noqa: E731
    assert Config.from_env({}, policy=fn).policy is fn


def test_policy_argument_name_is_checked():
    with pytest.raises(ConfigError, match="policy='fast'"):
        tiermem.Offloader(policy="fast")


@pytest.mark.parametrize("policy", ["nvme", "recompute,nvme", "auto,cpu"])
def test_unavailable_policies_fail_clearly_at_construction(policy):
    # auto in a preference list: auto decides alone; nvme: no directory given.
    with pytest.raises(ConfigError, match=policy.split(",")[-1] if "auto" not in policy else "auto"):
        tiermem.Offloader(policy=policy, nvme_dir=None)


@pytest.mark.parametrize("given, order", [
    ("recompute", ["recompute", "keep"]),
    ("Recompute, CPU", ["recompute", "cpu", "keep"]),
    (["recompute", "cpu"], ["recompute", "cpu", "keep"]),
    ((tiermem.Tier.RECOMPUTE, tiermem.Tier.KEEP), ["recompute", "keep"]),
    ("cpu", ["cpu", "keep"]),
])
def test_policy_preference_lists(given, order):
    off = tiermem.Offloader(policy=given)
    assert [t.value for t in tiermem.testing.tier_order(off)] == order


@pytest.mark.parametrize("bad", ["recompute,gpu", "cpu,", ",", "auto,cpu"])
def test_bad_policy_lists_name_the_value(bad, monkeypatch):
    monkeypatch.setenv("TIERMEM_POLICY", bad)
    with pytest.raises(ConfigError, match="TIERMEM_POLICY") as e:
        tiermem.Offloader()
    assert repr(bad) in str(e.value)


def test_disable_variable_makes_offloader_a_no_op(monkeypatch):
    monkeypatch.setenv("TIERMEM_DISABLE", "1")
    off = tiermem.Offloader(policy="cpu", min_offload_bytes=0)
    x = torch.randn(64, 64, requires_grad=True)
    with off as ctx:
        y = x.exp()
        y.add_(1)   # without hooks autograd itself raises for this: proof no hooks ran
        loss = y.sum()
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as err:
        loss.backward()
    assert not isinstance(err.value, tiermem.TierMemError)
    assert sum(ctx.stats.count_by_tier.values()) == 0 and off.stats is ctx.stats


def test_env_table_lists_every_variable():
    table = tiermem.env_table_markdown()
    for f in dataclasses.fields(Config):
        assert f"`{f.metadata['env']}`" in table and f"`{f.name}`" in table


def test_the_settings_page_shows_the_table_generated_from_config():
    """The docs' settings page includes the table the docs build writes from
    Config (never a pasted copy that can go stale), and the README links to it."""
    page = (ROOT / "docs" / "settings.md").read_text()
    assert "_generated/settings_table.md" in page
    assert "| `TIERMEM_" not in page, "a pasted TIERMEM_* table in docs/settings.md"
    assert "docs/settings.md" in (ROOT / "README.md").read_text()


def test_log_level_is_set_only_when_asked():
    import logging
    logger = logging.getLogger("tiermem")
    logger.setLevel(logging.ERROR)
    Config.from_env({})
    assert logger.level == logging.ERROR      # left to the user's setup
    Config.from_env({"TIERMEM_LOG": "debug"})
    assert logger.level == logging.DEBUG
    logger.setLevel(logging.NOTSET)


def test_a_misspelt_variable_warns_once_naming_the_closest_setting():
    with tiermem.testing.fresh_env_warnings():
        env = {"TIERMEM_NVME_DRI": "/tmp/x", "TIERMEM_POLICY": "keep"}
        with pytest.warns(UserWarning, match=r"TIERMEM_NVME_DRI .*did you mean TIERMEM_NVME_DIR\?"):
            cfg = Config.from_env(env)
        assert cfg.nvme_dir is None    # ignored, not guessed
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            Config.from_env(env)       # once per name per process


def test_settings_and_the_projects_own_variables_do_not_warn():
    with tiermem.testing.fresh_env_warnings():
        import warnings
        env = {f.metadata["env"]: "" for f in dataclasses.fields(Config)}
        env.update({"TIERMEM_BENCH_NVME_DIR": "/x", "TIERMEM_CI_VENV": "/v",
                    "TIERMEM_TEST_TIMEOUT_S": "5", "TIERMEM_SUITE_SECONDS": "9", "OTHER": "1"})
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            Config.from_env(env)


# -- integers: ASCII digits only ---------------------------------------------------

@pytest.mark.parametrize("text", ["4_0", "٤", "５", "+4", "-4", "4.0", "0x10", "1e1", "4 0"])
def test_integer_settings_take_ascii_digits_only(text):
    with pytest.raises(ConfigError) as err:
        Config.from_env({"TIERMEM_IO_THREADS": text})
    assert f"TIERMEM_IO_THREADS={text!r}" in str(err.value)
    with pytest.raises(ConfigError) as err:
        Config.from_env({}, io_threads=text)
    assert f"io_threads={text!r}" in str(err.value)


def test_integer_settings_allow_surrounding_whitespace():
    assert Config.from_env({"TIERMEM_IO_THREADS": " 16 "}).io_threads == 16
    assert Config.from_env({}, io_threads="\t2\n").io_threads == 2


# -- which name an error gives a setting -------------------------------------------

def test_setting_name_is_the_argument_when_given_as_one_else_the_variable():
    """NOTE [Setting names in messages]."""
    env = {"TIERMEM_NVME_DIR": "/tmp/a", "TIERMEM_CPU_BUDGET": "1GiB"}
    cfg = Config.from_env(env, nvme_dir="/tmp/b", policy=None)
    assert cfg.setting_name("nvme_dir") == "nvme_dir"
    assert cfg.setting_name("cpu_budget") == "TIERMEM_CPU_BUDGET"
    assert cfg.setting_name("policy") == "TIERMEM_POLICY"      # None: not given
    assert Config.from_env(env).setting_name("nvme_dir") == "TIERMEM_NVME_DIR"
    assert Config().setting_name("nvme_dir") == "TIERMEM_NVME_DIR"


def test_replace_records_its_changes_as_arguments():
    cfg = Config.from_env({"TIERMEM_NVME_DIR": "/tmp/a"}, cpu_budget="1GiB")
    new = cfg.replace(nvme_dir="/tmp/b", cpu_budget=None)
    assert new.setting_name("nvme_dir") == "nvme_dir"
    assert new.setting_name("cpu_budget") == "TIERMEM_CPU_BUDGET"
    assert cfg.setting_name("nvme_dir") == "TIERMEM_NVME_DIR"   # the original is unchanged
    assert new == dataclasses.replace(cfg, nvme_dir="/tmp/b", cpu_budget=None)


# -- the default cpu budget in a memory cgroup (NOTE [Container memory limits]) ----

_GiB = 2**30


def _cgroup_v2(root, limit, current, inactive_file=None):
    (root / "memory.max").write_text(f"{limit}\n")
    (root / "memory.current").write_text(f"{current}\n")
    if inactive_file is not None:
        (root / "memory.stat").write_text(
            f"anon 123\nfile 456\ninactive_file {inactive_file}\nactive_file 7\n")
    return str(root)


def _cgroup_v1(root, limit, usage, inactive_file=None):
    mem = root / "memory"
    mem.mkdir()
    (mem / "memory.limit_in_bytes").write_text(f"{limit}\n")
    (mem / "memory.usage_in_bytes").write_text(f"{usage}\n")
    if inactive_file is not None:
        (mem / "memory.stat").write_text(
            f"cache 9\ninactive_file 1\ntotal_inactive_file {inactive_file}\n")
    return str(root)


def test_cgroup_v2_limit_less_usage_is_available(tmp_path):
    from tiermem.memory.cgroup import cgroup_memory_available_bytes
    root = _cgroup_v2(tmp_path, 8 * _GiB, 3 * _GiB)
    assert cgroup_memory_available_bytes(root) == 5 * _GiB


def test_cgroup_inactive_file_cache_is_not_counted_as_used(tmp_path):
    from tiermem.memory.cgroup import cgroup_memory_available_bytes
    root = _cgroup_v2(tmp_path, 8 * _GiB, 8 * _GiB, inactive_file=2 * _GiB)
    assert cgroup_memory_available_bytes(root) == 2 * _GiB


def test_cgroup_v2_max_means_no_limit(tmp_path):
    from tiermem.memory.cgroup import cgroup_memory_available_bytes
    assert cgroup_memory_available_bytes(_cgroup_v2(tmp_path, "max", 3 * _GiB)) is None


def test_cgroup_v1_limit_less_usage_is_available(tmp_path):
    from tiermem.memory.cgroup import cgroup_memory_available_bytes
    root = _cgroup_v1(tmp_path, 4 * _GiB, 3 * _GiB, inactive_file=1 * _GiB)
    assert cgroup_memory_available_bytes(root) == 2 * _GiB


def test_cgroup_v1_huge_limit_means_no_limit(tmp_path):
    from tiermem.memory.cgroup import cgroup_memory_available_bytes
    assert cgroup_memory_available_bytes(_cgroup_v1(tmp_path, 9223372036854771712, 1)) is None


def test_cgroup_over_its_limit_has_nothing_available(tmp_path):
    from tiermem.memory.cgroup import cgroup_memory_available_bytes
    assert cgroup_memory_available_bytes(_cgroup_v2(tmp_path, 2 * _GiB, 3 * _GiB)) == 0


@pytest.mark.parametrize("files", ["none", "limit only", "garbage"])
def test_cgroup_files_that_cannot_be_read_mean_no_limit_known(tmp_path, files):
    from tiermem.memory.cgroup import cgroup_memory_available_bytes
    if files == "limit only":
        (tmp_path / "memory.max").write_text(f"{_GiB}\n")
    elif files == "garbage":
        _cgroup_v2(tmp_path, "lots", 1)
    assert cgroup_memory_available_bytes(str(tmp_path)) is None


@pytest.mark.parametrize("cgroup_gib, expected_gib", [(None, 8), (6, 3), (40, 8)])
def test_default_cpu_budget_is_half_the_least_of_ram_and_the_cgroup_room(
        tmp_path, monkeypatch, cgroup_gib, expected_gib):
    import collections
    from tiermem.runtime import placement
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    mem = collections.namedtuple("mem", "available total")(16 * _GiB, 64 * _GiB)
    monkeypatch.setattr("psutil.virtual_memory", lambda: mem)
    if cgroup_gib is not None:
        _cgroup_v2(tmp_path, (cgroup_gib + 1) * _GiB, 1 * _GiB)
    with tiermem.testing.cgroup_root(tmp_path):
        assert placement.default_cpu_budget_bytes() == expected_gib * _GiB
        off = tiermem.Offloader(policy="cpu")
        try:
            assert off.cpu_budget_bytes == expected_gib * _GiB
        finally:
            off.close()

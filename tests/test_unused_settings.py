"""A setting that does nothing under the chosen policy is warned about, once,
naming the setting as given, its value and the policy (NOTE [Settings a
policy ignores])."""

import warnings

import pytest

import tiermem


def _warnings_of(**kwargs) -> list:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tiermem.Offloader(**kwargs).close()
    return [str(w.message) for w in caught if "has no effect" in str(w.message)]


def test_a_device_budget_under_policy_cpu_is_warned_about_once():
    first = _warnings_of(policy="cpu", device_budget="37%")
    assert first == ["tiermem: device_budget='37%' has no effect under policy='cpu'; "
                     "it is ignored"]
    assert _warnings_of(policy="cpu", device_budget="37%") == []


def test_an_environment_variable_is_named_as_the_variable(monkeypatch):
    monkeypatch.setenv("TIERMEM_DEVICE_BUDGET", "3GiB")
    (msg,) = _warnings_of(policy="keep")
    assert msg.startswith("tiermem: TIERMEM_DEVICE_BUDGET='3221225472' has no effect under "
                          "policy='keep'")


def test_an_nvme_dir_under_a_policy_without_nvme_is_warned_about(tmp_path):
    (msg,) = _warnings_of(policy="recompute,cpu", nvme_dir=str(tmp_path))
    assert f"nvme_dir='{tmp_path}'" in msg and "policy='recompute,cpu'" in msg


def test_agree_ranks_off_outside_auto_is_warned_about():
    (msg,) = _warnings_of(policy="cpu", agree_ranks=False)
    assert msg.startswith("tiermem: agree_ranks='False' has no effect")


@pytest.mark.parametrize("kwargs", [
    dict(policy="auto", device_budget="41%"),
    dict(policy="cpu", device_budget=None, agree_ranks=True),    # defaults: nothing set
    dict(policy="cpu", disable=True, device_budget="42%"),       # tiermem does nothing at all
])
def test_settings_in_force_are_not_warned_about(kwargs):
    assert _warnings_of(**kwargs) == []


@pytest.mark.parametrize("policy", ["nvme", "recompute,nvme", None])
def test_an_nvme_dir_where_nvme_may_be_used_is_not_warned_about(tmp_path, policy):
    assert _warnings_of(policy=policy, nvme_dir=str(tmp_path / "spill")) == []

"""``tiermem.integrations.lightning.TierMemCallback``: a Lightning fit with the
callback ends with parameters bit-identical (``torch.equal``) to the same fit
without it, under keep, cpu, nvme, recompute and auto at 50%, with gradient
accumulation and under manual optimization, with validation batches between
the training steps; the policy's tiers were used (the callback's Offloader's
stats, and what ``log_stats=True`` logged). After a fit, and after a fit whose
training step raised, nothing is left wrapped or attached and the Offloader
is closed; a second fit with the same callback works. Bad settings raise
``ConfigError`` when the callback is made. The fits are those of
``examples/lightning_callback.py``; a slow test runs it as a script.
"""

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("lightning", reason="lightning is not installed (pip install -e '.[test]')")

import tiermem  # noqa: E402
from tiermem.integrations.lightning import TierMemCallback  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "lightning_callback.py")
sys.path.insert(0, os.path.dirname(EXAMPLE))
import lightning_callback as example  # noqa: E402

MIN = 4096   # this model's activations are 32 KiB; its biases' grads stay small


@pytest.fixture(autouse=True)
def _restore_global_state():
    """``Trainer(deterministic=True)`` turns deterministic algorithms on for the
    process and ``seed_everything`` sets variables: both are put back."""
    det = torch.are_deterministic_algorithms_enabled()
    warn = torch.is_deterministic_algorithms_warn_only_enabled()
    env = dict(os.environ)
    yield
    torch.use_deterministic_algorithms(det, warn_only=warn)
    os.environ.clear()
    os.environ.update(env)


@pytest.fixture(scope="module")
def reference():
    """Final parameters of the plain fits, by (grad_accum, manual)."""
    cache = {}

    def get(grad_accum=1, manual=False):
        key = (grad_accum, manual)
        if key not in cache:
            cache[key], _, _ = example.fit(None, grad_accum=grad_accum, manual=manual)
        return cache[key]
    return get


def _callback(policy, tmp_path, **kw):
    settings = {"min_offload_bytes": MIN}
    if policy in ("nvme", "auto"):
        settings["nvme_dir"] = str(tmp_path / "nvme")
    if policy == "auto":
        settings["device_budget"] = "50%"
    return TierMemCallback(policy=policy, **settings, **kw)


def _assert_equal(params, ref):
    differ = [n for n in ref if not torch.equal(params[n], ref[n])]
    assert not differ, f"final parameters differ: {differ}"


def _assert_left_nothing(cb, model):
    assert cb.offloader.closed
    assert "training_step" not in vars(model)
    assert not model._forward_pre_hooks and not model._forward_hooks


def _check_fit(policy, tmp_path, reference, grad_accum=1, manual=False):
    cb = _callback(policy, tmp_path, log_stats=True)
    params, trainer, model = example.fit(cb, grad_accum=grad_accum, manual=manual)
    _assert_equal(params, reference(grad_accum, manual))
    stats = cb.offloader.stats
    assert example.tiers_used(policy, stats), str(stats)
    logged = trainer.callback_metrics
    assert float(logged[f"tiermem/{'keep' if policy == 'auto' else policy}_bytes"]) == \
        stats.bytes_by_tier["keep" if policy == "auto" else policy]
    assert float(logged["tiermem/offloaded_bytes"]) == stats.offloaded_bytes
    assert "val_loss" in logged   # validation ran between the steps (grad off: no step)
    _assert_left_nothing(cb, model)


@pytest.mark.parametrize("policy", [
    "cpu", "auto",
    pytest.param("keep", marks=pytest.mark.slow),
    pytest.param("nvme", marks=pytest.mark.slow),
    pytest.param("recompute", marks=pytest.mark.slow)])
def test_fit_with_callback_matches_plain_fit(policy, tmp_path, reference):
    _check_fit(policy, tmp_path, reference)


@pytest.mark.parametrize("policy", [
    "nvme",
    pytest.param("cpu", marks=pytest.mark.slow),
    pytest.param("recompute", marks=pytest.mark.slow),
    pytest.param("auto", marks=pytest.mark.slow)])
def test_gradient_accumulation_matches_plain_fit(policy, tmp_path, reference):
    _check_fit(policy, tmp_path, reference, grad_accum=2)


@pytest.mark.parametrize("policy", [
    "cpu", pytest.param("auto", marks=pytest.mark.slow)])
def test_manual_optimization_matches_plain_fit(policy, tmp_path, reference):
    """Under manual optimization the module is attached: ``self(x)`` is the step."""
    _check_fit(policy, tmp_path, reference, manual=True)


def test_second_fit_with_the_same_callback_gets_a_new_offloader(tmp_path):
    cb = _callback("cpu", tmp_path)
    first = cb.offloader
    _, _, model = example.fit(cb, validate=False)
    assert cb.offloader is first and first.closed
    _assert_left_nothing(cb, model)
    _, _, model = example.fit(cb, validate=False)
    assert cb.offloader is not first
    assert cb.offloader.stats.count_by_tier["cpu"] > 0
    _assert_left_nothing(cb, model)


def test_pickled_callback_builds_its_own_offloader(tmp_path):
    """A copy sent to another process (``ddp_spawn``) carries the settings,
    not the Offloader (its threads and pools are this process's)."""
    import pickle

    cb = _callback("cpu", tmp_path)
    copy = pickle.loads(pickle.dumps(cb))
    assert copy.offloader is None and not cb.offloader.closed
    _, _, model = example.fit(copy, validate=False)
    assert copy.offloader.stats.count_by_tier["cpu"] > 0
    _assert_left_nothing(copy, model)
    cb.offloader.close()


class _Recording(TierMemCallback):
    """Remembers the module it was fitted with."""

    def on_fit_start(self, trainer, pl_module):
        self.module = pl_module
        super().on_fit_start(trainer, pl_module)


def test_training_step_that_raises_leaves_nothing_behind(tmp_path):
    cb = _Recording(policy="nvme", min_offload_bytes=MIN, nvme_dir=str(tmp_path / "nvme"))
    with pytest.raises(RuntimeError, match="failed on purpose"):
        example.fit(cb, fail_at_step=1, validate=False)
    assert cb.module.global_step == 1   # step 0 ran under the Offloader, step 1 raised
    _assert_left_nothing(cb, cb.module)
    assert not os.path.exists(tmp_path / "nvme") or not os.listdir(tmp_path / "nvme")


@pytest.mark.parametrize("settings, name", [
    ({"policy": "sideways"}, "policy"),
    ({"policy": "auto", "device_budget": "150%"}, "device_budget"),
    ({"policy": "cpu", "min_offload_bytes": -1}, "min_offload_bytes"),
    ({"policy": "cpu", "log_stats": "yes"}, "log_stats"),
])
def test_bad_settings_raise_config_error_when_made(settings, name):
    with pytest.raises(tiermem.ConfigError, match=name):
        TierMemCallback(**settings)


@pytest.mark.slow
def test_pytorch_lightning_package_callback(tmp_path):
    """The ``pytorch_lightning`` package's Trainer takes its own callback class."""
    pl = pytest.importorskip("pytorch_lightning", reason="pytorch_lightning is not installed")
    from tiermem.integrations.pytorch_lightning import TierMemCallback as PLCallback

    def run(callback):
        pl.seed_everything(0, verbose=False)
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Dropout(0.1),
                                    torch.nn.GELU(), torch.nn.Linear(64, 1))

        class Module(pl.LightningModule):
            def __init__(self):
                super().__init__()
                self.net = model

            def training_step(self, batch, batch_idx):
                x, y = batch
                return torch.nn.functional.mse_loss(self.net(x).squeeze(-1), y)

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.1)

        g = torch.Generator().manual_seed(1)
        data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(
            torch.randn(96, 64, generator=g), torch.randn(96, generator=g)), batch_size=32)
        trainer = pl.Trainer(max_steps=3, accelerator="cpu", devices=1, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, deterministic=True,
                             callbacks=[callback] if callback else [])
        trainer.fit(Module(), data)
        return [p.detach().clone() for p in model.parameters()]

    ref = run(None)
    cb = PLCallback(policy="cpu", min_offload_bytes=MIN)
    got = run(cb)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    assert cb.offloader.stats.count_by_tier["cpu"] > 0 and cb.offloader.closed


@pytest.mark.slow
def test_example_script_runs(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env = {k: v for k, v in env.items() if not k.startswith("TIERMEM_")}
    res = subprocess.run(
        [sys.executable, EXAMPLE, "--policy", "cpu", "--policy", "auto", "--steps", "3"],
        capture_output=True, text=True, timeout=240, env=env, cwd=str(tmp_path))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    for policy in ("cpu", "auto"):
        assert f"policy {policy}: final parameters bit-identical; tiers used" in res.stdout, \
            res.stdout

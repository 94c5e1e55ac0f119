"""A parameter a recipe holds as it is, changed between the forward and the
backward (issue 14 #9; NOTE [Parameters changed before backward] in
tiermem/tracking/params.py).

Plain autograd uses the activations of the forward; a recompute regenerates
them from the parameter, so a change it cannot see would give other
gradients. Each kind of change either gives plain autograd's gradients or
raises one clear ``TierMemError`` naming the parameter, never silently other
gradients:

- written in place through ``.data`` (same storage; no version counter moves):
  seen by a content fingerprint (``check_params``, on by default): raises;
- written in place under ``no_grad`` (its version moves): raises;
- replaced (``p.data = new``): the recipe holds the old storage, so it
  regenerates exactly what the forward computed.
"""

import contextlib

import pytest
import torch

import tiermem
import tiermem.testing

POLICIES = ["recompute", "recompute,cpu"]


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = torch.nn.LayerNorm(64)
        self.gain = torch.nn.Parameter(torch.ones(64))
        self.lin = torch.nn.Linear(64, 64)

    def forward(self, x):
        # ln's output and h * gain are dropped and recomputed: their recipes
        # hold ln.weight, ln.bias and gain as they are. Linear's parameters
        # are never held by a recipe (addmm is not recomputable).
        h = (self.ln(x) * self.gain).sin()
        return self.lin(h).sin()


def _step(net, ctx, change=None, seed=0):
    torch.manual_seed(seed)
    x = torch.randn(32, 64, requires_grad=True)
    with ctx:
        loss = net(x).square().sum()
    if change is not None:
        change(net)
    for p in net.parameters():
        p.grad = None
    loss.backward()
    return [x.grad] + [p.grad for p in net.parameters()]


def _net():
    torch.manual_seed(1)
    net = _Net()
    with torch.no_grad():   # not the constant init: a change must be seen on any values
        for p in net.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return net


def _data_add(p):
    p.data.add_(0.5)


def _data_copy(p):
    p.data.copy_(p.data * 2 + 1)


def _no_grad_add(p):
    with torch.no_grad():
        p.add_(0.5)


def _fill(p):
    p.data.fill_(0.25)


WRITES = {"data.add_": _data_add, "data.copy_": _data_copy, "data.fill_": _fill,
          "no_grad add_": _no_grad_add}
PARAMS = {"ln.weight": lambda n: n.ln.weight, "ln.bias": lambda n: n.ln.bias,
          "gain": lambda n: n.gain}


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("write", sorted(WRITES))
@pytest.mark.parametrize("param", sorted(PARAMS))
def test_a_parameter_written_before_backward_raises_naming_it(policy, write, param):
    net = _net()
    off = tiermem.Offloader(policy=policy, min_offload_bytes=0)
    with pytest.raises(tiermem.TierMemError) as err:
        _step(net, off, lambda n: WRITES[write](PARAMS[param](n)))
    msg = str(err.value)
    assert f"_Net.{param}" in msg, msg
    assert "between the forward and the backward" in msg, msg
    assert "check_params" in msg or "no_grad" in write, msg
    off.close()


@pytest.mark.parametrize("policy", POLICIES)
def test_a_raise_at_one_step_leaves_the_offloader_usable(policy):
    net = _net()
    off = tiermem.Offloader(policy=policy, min_offload_bytes=0)
    with pytest.raises(tiermem.TierMemError):
        _step(net, off, lambda n: _data_add(n.ln.bias))
    ref = _step(net, contextlib.nullcontext(), seed=3)
    got = _step(net, off, seed=3)
    assert all(torch.equal(g, r) for g, r in zip(got, ref))
    off.close()


@pytest.mark.parametrize("policy", ["keep", "cpu"] + POLICIES)
@pytest.mark.parametrize("param", sorted(PARAMS))
def test_a_parameter_replaced_before_backward_gives_plain_gradients(policy, param):
    """Plain autograd reads a saved leaf itself (the new storage, for ln.weight
    and gain, which their backward formulas use) and the forward's activations
    (the old values): so does every tier."""
    def replace(n):
        p = PARAMS[param](n)
        p.data = p.data * 2 + 1

    ref = _step(_net(), contextlib.nullcontext(), replace)
    off = tiermem.Offloader(policy=policy, min_offload_bytes=0)
    got = _step(_net(), off, replace)
    if "recompute" in policy:
        assert off.stats.recompute_count > 0, "nothing was recomputed: the test tests nothing"
    assert all(torch.equal(g, r) for g, r in zip(got, ref))
    off.close()


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("write", ["data.add_", "data.copy_"])
def test_a_linear_written_before_backward_gives_plain_gradients(policy, write):
    """No recipe holds Linear's parameters (addmm is not recomputable): its
    backward reads them as plain autograd does, current values included."""
    def change(n):
        WRITES[write](n.lin.weight)
        WRITES[write](n.lin.bias)

    ref = _step(_net(), contextlib.nullcontext(), change)
    off = tiermem.Offloader(policy=policy, min_offload_bytes=0)
    got = _step(_net(), off, change)
    assert off.stats.recompute_count > 0
    assert all(torch.equal(g, r) for g, r in zip(got, ref))
    off.close()


@pytest.mark.parametrize("policy", POLICIES)
def test_a_training_loop_with_an_optimizer_never_raises(policy):
    """The fingerprint is taken again at every step: an optimizer step after
    backward (also through ``.data``) is no change between forward and backward."""
    def loop(ctx_of):
        net = _net()
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        out = []
        for i in range(4):
            out.append(_step(net, ctx_of(), seed=i))
            opt.step()
            net.ln.bias.data.mul_(0.5)   # a change outside forward-to-backward
        return out

    ref = loop(contextlib.nullcontext)
    off = tiermem.Offloader(policy=policy, min_offload_bytes=0)
    got = loop(lambda: off)
    assert off.stats.recompute_count > 0
    for g, r in zip(got, ref):
        assert all(torch.equal(a, b) for a, b in zip(g, r))
    off.close()


def test_with_check_params_off_a_data_write_is_not_seen():
    """``check_params=False`` (documented): a write through ``.data`` between
    forward and backward is not seen, and the recompute uses the new values
    (gradients differ from plain autograd's). Version bumps still raise."""
    change = lambda n: _data_add(n.ln.bias)   # noqa: E731
    ref = _step(_net(), contextlib.nullcontext(), change)
    off = tiermem.Offloader(policy="recompute", min_offload_bytes=0, check_params=False)
    got = _step(_net(), off, change)
    assert not all(torch.equal(g, r) for g, r in zip(got, ref))
    with pytest.raises(tiermem.TierMemError, match="_Net.ln.bias"):
        _step(_net(), off, lambda n: _no_grad_add(n.ln.bias))
    off.close()


def test_check_params_is_read_from_the_environment(monkeypatch):
    monkeypatch.setenv("TIERMEM_CHECK_PARAMS", "0")
    assert tiermem.Config.from_env().check_params is False
    monkeypatch.setenv("TIERMEM_CHECK_PARAMS", "maybe")
    with pytest.raises(tiermem.ConfigError, match="TIERMEM_CHECK_PARAMS='maybe'"):
        tiermem.Config.from_env()
    monkeypatch.delenv("TIERMEM_CHECK_PARAMS")
    assert tiermem.Config.from_env().check_params is True


@pytest.mark.parametrize("policy", POLICIES)
def test_on_the_cuda_path_a_data_write_raises_at_the_end_of_backward(policy):
    """The comparison CUDA tensors get (no host sync in backward: a device
    flag read by a callback at the end of backward), run on the CPU."""
    with tiermem.testing.deferred_param_checks():
        net = _net()
        off = tiermem.Offloader(policy=policy, min_offload_bytes=0)
        with pytest.raises(tiermem.TierMemError, match="_Net.ln.bias") as err:
            _step(net, off, lambda n: _data_add(n.ln.bias))
        assert "gradients of this backward pass" in str(err.value)
        assert net.ln.weight.grad is not None, "raised before backward ended"
        ref = _step(_net(), contextlib.nullcontext(), seed=3)
        got = _step(_net(), off, seed=3)   # no change: no error, exact
        assert all(torch.equal(g, r) for g, r in zip(got, ref))
        off.close()


@pytest.mark.gpu
@pytest.mark.parametrize("policy", POLICIES)
def test_cuda_data_write_raises_at_the_end_of_backward_after_one_sync(policy):
    import warnings

    def syncs_in_backward(check, change=None):
        net = _net().cuda()
        off = tiermem.Offloader(policy=policy, min_offload_bytes=0, check_params=check)
        counts = []
        for i in range(3):   # the last one is counted (warm caches and pools)
            torch.manual_seed(0)
            x = torch.randn(32, 64, device="cuda", requires_grad=True)
            with off:
                loss = net(x).square().sum()
            if change is not None and i == 2:
                change(net)
            torch.cuda.synchronize()
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    loss.backward()
                finally:
                    torch.cuda.set_sync_debug_mode(0)
            counts.append(sum("synchroniz" in str(w.message) for w in seen))
        assert off.stats.recompute_count > 0
        off.close()
        return counts[-1]

    # The check adds one host sync per backward, at its end, and none before.
    assert syncs_in_backward(True) == syncs_in_backward(False) + 1
    with pytest.raises(tiermem.TierMemError, match="_Net.ln.bias"):
        syncs_in_backward(True, lambda n: _data_add(n.ln.bias))


def _flip(p):
    p.data.copy_(p.data.flip(0))


@pytest.mark.parametrize("deferred", [False, True])
@pytest.mark.parametrize("param", ["ln.bias", "gain"])
def test_a_write_that_only_permutes_a_small_parameter_raises(param, deferred):
    """A parameter of at most ``SNAPSHOT_MAX_BYTES`` is compared word for word
    (NOTE [Parameters changed before backward], rule 3): reordering its values
    keeps their sum and xor, and is still seen."""
    from tiermem.tracking.params import SNAPSHOT_MAX_BYTES
    net = _net()
    assert PARAMS[param](net).nbytes <= SNAPSHOT_MAX_BYTES
    ctx = tiermem.testing.deferred_param_checks() if deferred else contextlib.nullcontext()
    with ctx:
        off = tiermem.Offloader(policy="recompute", min_offload_bytes=0)
        with pytest.raises(tiermem.TierMemError, match=f"_Net.{param}"):
            _step(net, off, lambda n: _flip(PARAMS[param](n)))
        off.close()


class _Wide(torch.nn.Module):
    """A recipe holding a parameter larger than ``SNAPSHOT_MAX_BYTES``."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.gain = torch.nn.Parameter(torch.randn(features))

    def forward(self, x):
        return (x * self.gain).sin().square().sum()


@pytest.mark.parametrize("deferred", [False, True])
def test_a_large_parameter_written_before_backward_raises(deferred):
    """Above ``SNAPSHOT_MAX_BYTES`` the fingerprint (sum and xor of the
    words) is compared: a ``.data`` write raises, no write gives plain
    autograd's gradients."""
    from tiermem.tracking.params import SNAPSHOT_MAX_BYTES
    features = SNAPSHOT_MAX_BYTES // 4 + 16
    ctx = tiermem.testing.deferred_param_checks() if deferred else contextlib.nullcontext()
    with ctx:
        torch.manual_seed(0)
        net = _Wide(features)
        x = torch.randn(4, features, requires_grad=True)
        off = tiermem.Offloader(policy="recompute", min_offload_bytes=0)
        with off:
            loss = net(x)
        net.gain.data.add_(0.5)
        with pytest.raises(tiermem.TierMemError, match="_Wide.gain"):
            loss.backward()
        net.gain.data.sub_(0.5)
        with off:
            loss = net(x)
        x.grad = None
        loss.backward()
        assert off.stats.recompute_count > 0
        got = x.grad.clone()
        x.grad = None
        net(x).backward()
        assert torch.equal(got, x.grad)
        off.close()

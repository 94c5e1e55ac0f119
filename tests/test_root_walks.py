"""An Offloader walks the module tree of each root once and keeps what it
found between steps (NOTE [Roots walked once] in tiermem/runtime/roots.py).
What a walk finds decides, in a step of a moving policy, that a saved tensor
sharing a buffer's or parameter's storage is never moved: these tests change
the model between steps in each way the note lists and check that the next
step still finds every buffer."""

import torch
import torch.nn as nn

import tiermem
from helpers import same_bits


class _Scaled(nn.Module):
    """Saves its buffer ``scale`` (``h * scale`` saves it for h's gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("scale", torch.full((8,), 2.0))
        self.extra = None

    def forward(self, x):
        h = self.lin(x).relu() * self.scale
        if self.extra is not None:
            h = self.extra(h)
        return h.square().sum()


class _Shift(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("shift", torch.full((8,), 0.5))

    def forward(self, h):
        return h * self.shift


def _step(off, model, dtype=torch.float32):
    torch.manual_seed(0)
    x = torch.randn(4, 8, dtype=dtype)
    with off:
        loss = model(x)
    loss.backward()
    return off.stats


def test_a_saved_buffer_is_never_moved_across_steps():
    model = _Scaled()
    off = tiermem.Offloader(policy="cpu", min_offload_bytes=0)
    first, second = _step(off, model), _step(off, model)
    assert first.param_count == second.param_count
    assert first.count_by_tier["cpu"] == second.count_by_tier["cpu"] > 0
    off.close()


def test_a_buffer_given_new_storage_is_found():
    """``.data = new`` keeps the tensor object and moves its storage."""
    model = _Scaled()
    off = tiermem.Offloader(policy="cpu", min_offload_bytes=0)
    before = _step(off, model)
    model.scale.data = torch.full((8,), 3.0)
    after = _step(off, model)
    assert after.param_count == before.param_count
    assert after.count_by_tier["cpu"] == before.count_by_tier["cpu"]
    off.close()


def test_buffers_replaced_by_to_are_found():
    """``Module.to`` puts new buffer tensors into ``_buffers`` directly (no
    registration): rule 4 of the note."""
    model = _Scaled()
    off = tiermem.Offloader(policy="cpu", min_offload_bytes=0)
    before = _step(off, model)
    model.to(torch.float64)
    after = _step(off, model, torch.float64)
    assert after.param_count == before.param_count
    assert after.count_by_tier["cpu"] == before.count_by_tier["cpu"]
    off.close()


def test_a_module_registered_between_steps_is_found_and_stays_exact():
    model, ref = _Scaled(), _Scaled()
    ref.load_state_dict(model.state_dict())
    off = tiermem.Offloader(policy="cpu", min_offload_bytes=0)
    before = _step(off, model)
    model.extra, ref.extra = _Shift(), _Shift()   # setattr registers it
    after = _step(off, model)
    assert after.param_count == before.param_count + 1    # its buffer, saved by mul
    assert after.count_by_tier["cpu"] == before.count_by_tier["cpu"]   # and not moved
    for p in model.parameters():
        p.grad = None
    _step(off, model)
    _step(tiermem.Offloader(policy="keep"), ref)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert same_bits(p.grad, q.grad)
    off.close()


def test_an_offloader_keeps_no_model_alive():
    """What the Offloader keeps of a walk holds no module and no tensor: a
    model dropped between steps is freed at once, parameters and buffers."""
    import gc
    import weakref
    model = _Scaled()
    off = tiermem.Offloader(policy="cpu", min_offload_bytes=0)
    _step(off, model)
    refs = [weakref.ref(t) for t in (model.lin.weight, model.scale)] + [weakref.ref(model)]
    del model
    gc.collect()
    assert all(r() is None for r in refs)
    _step(off, _Scaled())   # a new model under the same Offloader
    off.close()


_HOOKS_SCRIPT = """
import gc, tiermem, tiermem.testing
hooks = tiermem.testing.registration_hooks_installed
before = hooks()
assert before == 0, before
a = tiermem.Offloader(policy="cpu")
b = tiermem.Offloader(policy="recompute")
assert hooks() == before + 3, (hooks(), before)
a.close()
assert hooks() == before + 3, "b still holds them"
del b
gc.collect()
assert hooks() == before, (hooks(), before)
c = tiermem.Offloader(policy="cpu")
assert hooks() == before + 3
c.close()
assert hooks() == before
# Closed Offloaders in reference cycles, collected by the garbage collector at
# any allocation, also inside another's taking of the hooks (a closed one's
# finalizer ran there and waited for the lock): no deadlock.
for i in range(300):
    gc.set_threshold(1 + i % 97, 1, 1)
    o = tiermem.Offloader(policy="cpu")
    o.cycle = o
    o.close()
    del o
gc.set_threshold(700, 10, 10)
gc.collect()
last = tiermem.Offloader(policy="cpu")   # takes up any release that had to wait
last.close()
assert hooks() == before, (hooks(), before)
print("ok")
"""


def test_the_registration_hooks_go_with_the_last_offloader():
    """NOTE [Registration hooks held while used]: torch's global registration
    hooks are installed while an Offloader lives and is not closed, once for
    all of them, and removed with the last (closed, or collected, also by the
    garbage collector while another Offloader takes them: that deadlocked). In
    a fresh interpreter: Offloaders other tests left alive would hold them here."""
    import subprocess
    import sys
    try:
        out = subprocess.run([sys.executable, "-c", _HOOKS_SCRIPT], capture_output=True,
                             text=True, timeout=120)
    except subprocess.TimeoutExpired:
        raise AssertionError("the script hung (a deadlock taking the hooks)") from None
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]

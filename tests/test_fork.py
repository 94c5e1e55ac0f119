"""After os.fork() a new Offloader in the child works, and one made before the
fork refuses clearly (issue 14 #4; NOTE [Fork] in offloader.py)."""

import os
import time

import pytest
import torch

import tiermem


def _grads_ok(off):
    x = torch.randn(1 << 14, requires_grad=True)
    x.sin().cos().exp().sum().backward()
    ref, x.grad = x.grad.clone(), None
    with off:
        y = x.sin().cos().exp()
    y.sum().backward()
    return torch.equal(x.grad, ref) and off.stats.offloaded_bytes > 0


def _child(parent_off, nvme_dir) -> int:
    torch.set_num_threads(1)
    for policy, engine in (("cpu", "auto"), ("nvme", "python"), ("nvme", "cpp")):
        if engine == "cpp" and tiermem.engine_info("cpp")["engine"] != "cpp":
            continue
        off = tiermem.Offloader(policy=policy, nvme_dir=nvme_dir, engine=engine,
                                min_offload_bytes=0)
        for _ in range(3):
            if not _grads_ok(off):
                return 12
        off.close()
    one_shot = tiermem.offload(policy="cpu", min_offload_bytes=0)
    if not _grads_ok(one_shot):
        return 13
    try:
        with parent_off:
            pass
        return 10                          # the parent's Offloader must refuse
    except tiermem.TierMemError as e:
        return 0 if "forked" in str(e) else 11


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork here")
def test_a_forked_child_makes_its_own_offloaders(tmp_path):
    parent_off = tiermem.Offloader(policy="cpu", min_offload_bytes=0)
    assert _grads_ok(parent_off)           # the process-wide workers exist now
    nv = tiermem.Offloader(policy="nvme", nvme_dir=str(tmp_path), engine="python",
                           min_offload_bytes=0)
    assert _grads_ok(nv)
    tiermem.offload(policy="cpu", min_offload_bytes=0)
    pid = os.fork()
    if pid == 0:                            # the child
        code = 1
        try:
            code = _child(parent_off, str(tmp_path))
        finally:
            os._exit(code)
    deadline = time.monotonic() + 60
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung (no worker thread finished its moves)")
        time.sleep(0.05)
    assert os.waitstatus_to_exitcode(status) == 0
    assert _grads_ok(parent_off)            # the parent is unaffected
    parent_off.close()
    nv.close()

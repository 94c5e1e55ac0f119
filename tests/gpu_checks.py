"""Checks shared by the GPU tests (they run only with a CUDA device)."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch


@contextlib.contextmanager
def forbid_host_waits(*job_classes):
    """Inside the block, a host wait for the GPU on this thread fails the test:
    torch's synchronizing calls raise (``set_sync_debug_mode("error")``, which
    is process-wide), and since that mode does not see event waits,
    ``torch.cuda.Event.synchronize`` and the ``wait_host`` of each of
    ``job_classes`` raise too when called on this thread (worker threads may
    wait for events: that is their job). Patches are undone on the way out."""
    me = threading.get_ident()

    def guarded(original):
        def wait(*args, **kwargs):
            if threading.get_ident() == me:
                raise AssertionError("host wait in the forward pass")
            return original(*args, **kwargs)
        return wait
    with pytest.MonkeyPatch.context() as mp:
        for cls in job_classes:
            mp.setattr(cls, "wait_host", guarded(cls.wait_host))
        mp.setattr(torch.cuda.Event, "synchronize", guarded(torch.cuda.Event.synchronize))
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(0)


def assert_same_step(got, ref) -> None:
    """``got`` and ``ref``, each ``(loss, [grads])``, are bit-identical."""
    assert torch.equal(got[0], ref[0])
    assert len(got[1]) == len(ref[1])
    for g, r in zip(got[1], ref[1]):
        assert torch.equal(g, r)

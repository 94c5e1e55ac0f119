"""Restores through the Python chain wait on the host for their read only
(NOTE [Waiting only for the read] in tiermem/tiers/nvme_chain.py).

The protocol (ReadThenCopy, ReadCopyJob) is not CUDA-specific: here the copy
is a plain function, so it runs on the CPU; the CUDA copy it stands for is
covered by tests/test_gpu_engine.py with the Python chain (verify=True).
"""

from __future__ import annotations

import threading

import pytest

import tiermem
import tiermem.testing
from tiermem.runtime.jobs import ReadCopyJob
from tiermem.runtime.step import Step
from tiermem.telemetry import StepStats
from tiermem.tiers.nvme_chain import PythonChain


class _Counts:
    def __init__(self) -> None:
        self.reads, self.copies, self.releases = [], 0, []
        self.lock = threading.Lock()

    def read(self):
        with self.lock:
            self.reads.append(threading.current_thread().name)

    def copy(self):
        with self.lock:
            self.copies += 1
        return None   # not a CUDA event: nothing to order a stream after

    def release(self, done):
        with self.lock:
            self.releases.append(done)


def _in_thread(fn, timeout_s=10.0):
    """Run ``fn`` on a thread; True if it returned within ``timeout_s``."""
    t = threading.Thread(target=fn, name="consumer", daemon=True)
    t.start()
    t.join(timeout_s)
    return not t.is_alive()


def test_consumer_reads_itself_when_no_chain_thread_has_started_it():
    """Its read queued behind a request that holds the only chain thread: the
    consumer does not wait for that request (the old ChainJob did)."""
    chain = PythonChain(1)
    gate = threading.Event()
    try:
        tiermem.testing.run_on_chain_thread(chain, gate.wait)   # the chain's thread is busy
        c = _Counts()
        job = ReadCopyJob(chain.read_then(c.read, c.copy, "reading x", c.release))
        assert not job.host_ready() and not job.done()
        assert _in_thread(job.order_before_use), "the consumer waited for the queue"
        assert c.reads == ["consumer"] and c.copies == 1 and c.releases == [None]
        assert job.done() and job.host_ready() and job.failed() is None
    finally:
        gate.set()
        chain.shutdown()
    assert c.reads == ["consumer"] and c.copies == 1   # the chain thread found it taken


def test_a_finished_read_leaves_the_consumer_no_host_wait():
    """Once the read is done, host_ready() is true even before the copy is
    issued: the consumer then issues it itself if the chain thread has not."""
    c = _Counts()
    copy_gate = threading.Event()
    chain_in_copy = threading.Event()

    def slow_copy():   # the chain thread is slow to issue the copy
        chain_in_copy.set()
        copy_gate.wait()
        return c.copy()

    chain = PythonChain(1)
    try:
        task = chain.read_then(c.read, slow_copy, "reading y", c.release)
        job = ReadCopyJob(task)
        assert chain_in_copy.wait(10.0)
        assert task.read_done() and job.host_ready() and not job.done()
        copy_gate.set()
        job.order_before_use()
    finally:
        chain.shutdown()
    assert c.copies == 1 and len(c.releases) == 1


@pytest.mark.parametrize("rounds", [200])
def test_read_and_copy_run_exactly_once_under_races(rounds):
    chain = PythonChain(2)
    try:
        for _ in range(rounds):
            c = _Counts()
            job = ReadCopyJob(chain.read_then(c.read, c.copy, "reading z", c.release))
            job.order_before_use()
            job.wait_host()
            tiermem.testing.run_on_chain_thread(chain, lambda: None).result()   # its run returned
            assert len(c.reads) == 1 and c.copies == 1 and c.releases == [None]
    finally:
        chain.shutdown()


def test_a_failed_read_reaches_the_consumer_and_releases_staging_once():
    c = _Counts()

    def bad_read():
        raise OSError(5, "Input/output error")

    chain = PythonChain(1)
    try:
        job = ReadCopyJob(chain.read_then(bad_read, c.copy, "reading w at offset 0",
                                          c.release))
        with pytest.raises(tiermem.TierMemError, match="reading w at offset 0 failed"):
            job.order_before_use()
        assert isinstance(job.failed(), tiermem.TierMemError) and job.done()
    finally:
        chain.shutdown()
    assert c.copies == 0 and c.releases == [None]


class _Job:
    """A restore in a given state (late, and whether the host must wait)."""

    def __init__(self, host_ready: bool) -> None:
        self._host_ready = host_ready

    def done(self):
        return False

    def host_ready(self):
        return self._host_ready

    def order_before_use(self, tensor=None):
        pass


class _Step:
    """What a finished restore reports to: Step.restored on a fresh StepStats."""

    def __init__(self) -> None:
        self.stats = StepStats()

    restored = Step.restored


@pytest.mark.parametrize("host_ready, host_waits", [(True, 0), (False, 1)])
def test_only_restores_that_block_the_host_count_as_host_waits(host_ready, host_waits):
    step = _Step()
    tiermem.testing.finish_restore(_Job(host_ready), step)
    assert step.stats.late_restores == 1
    assert step.stats.host_waits == host_waits

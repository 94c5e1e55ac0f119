"""Removing stale private directories never blocks and never touches what is
not ours (issue 14 #3): on shared scratch space any local user can leave a
directory named like tiermem's, with anything in it."""

import os
import threading
import time

import pytest

import tiermem
from tiermem.spilldir import remove_stale_dirs

_DEAD = "tiermem-999999999-0-aaaa"     # no such pid here


def _aged(path, seconds=7200):
    old = time.time() - seconds
    os.utime(path, (old, old))


def _in_thread(fn, timeout_s=20):
    out = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(timeout_s)
    return t, out


def test_a_fifo_named_like_the_owner_lock_does_not_block_the_start(tmp_path):
    d = tmp_path / _DEAD
    d.mkdir(mode=0o700)
    fifo = d / "owner.lock"
    os.mkfifo(fifo)
    _aged(d)
    t, out = _in_thread(lambda: tiermem.Offloader(policy="nvme", nvme_dir=str(tmp_path)))
    try:
        assert not t.is_alive(), "the Offloader's start blocked on a FIFO in the NVMe dir"
    finally:
        if t.is_alive():   # unblock the probe: a writer lets the blocked open return
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            t.join(5)
    out[0].close()
    assert d.exists(), "a directory whose lock is not a regular file is not ours to remove"


@pytest.mark.skipif(os.getuid() != 0, reason="making another user's directory needs root")
def test_another_users_directory_is_left_alone_without_opening_anything(tmp_path):
    d = tmp_path / _DEAD
    d.mkdir(mode=0o755)
    fifo = d / "owner.lock"
    os.mkfifo(fifo)
    os.chown(d, 65534, 65534)
    os.chown(fifo, 65534, 65534)
    _aged(d)
    t, out = _in_thread(lambda: remove_stale_dirs(str(tmp_path)))
    if t.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        t.join(5)
        pytest.fail("the stale-directory probe opened another user's FIFO")
    assert out == [[]] and d.exists()


def test_a_stale_directory_of_ours_is_still_removed(tmp_path):
    d = tmp_path / _DEAD
    d.mkdir(mode=0o700)
    (d / "owner.lock").write_text("")
    (d / "arena-0.bin").write_bytes(b"\0" * 4096)
    _aged(d)
    assert remove_stale_dirs(str(tmp_path)) == [str(d)] and not d.exists()

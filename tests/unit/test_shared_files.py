"""shared_files: a bounded wait for a file another node writes, and a lock file that needs no flock."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
import time

import pytest

from tula_hpc.cluster import shared_files


def test_a_file_that_shows_late_is_waited_for_up_to_the_bound(tmp_path, monkeypatch):
    monkeypatch.setattr(shared_files, "FILE_POLL_S", 0.01)
    late = tmp_path / "late.pkl"
    threading.Timer(0.2, late.write_text, ["x"]).start()
    assert not shared_files.appeared(tmp_path, late.exists, within_s=0)
    assert shared_files.appeared(tmp_path, late.exists, within_s=5)
    assert not shared_files.appeared(tmp_path / "none", (tmp_path / "none" / "x").exists, within_s=0.05)


def test_the_lock_excludes_a_second_holder_until_released_and_needs_no_flock(tmp_path, monkeypatch):
    """fcntl.flock fails on Lustre mounted without flock; the lock file does not use it."""
    import fcntl

    def refused(*args):
        raise OSError(37, "No locks available")

    monkeypatch.setattr(fcntl, "flock", refused)
    monkeypatch.setattr(shared_files, "LOCK_POLL_S", 0.01)
    lock, order = tmp_path / "allocation.lock", []

    def second():
        with shared_files.exclusive_lock(lock):
            order.append("second")

    with shared_files.exclusive_lock(lock):
        holder = json.loads(lock.read_text())
        assert holder["host"] == socket.gethostname() and holder["pid"] == os.getpid()
        waiting = threading.Thread(target=second)
        waiting.start()
        time.sleep(0.1)
        order.append("first")
    waiting.join(5)
    assert order == ["first", "second"] and not lock.exists()


@pytest.mark.spawns
def test_a_stale_lock_is_broken(tmp_path, monkeypatch):
    """Its holder died on this host (its pid runs no more), or another host's is older than LOCK_STALE_S."""
    monkeypatch.setattr(shared_files, "LOCK_POLL_S", 0.01)
    lock = tmp_path / "allocation.lock"
    dead = subprocess.Popen(["true"])
    dead.wait()
    for holder in (
        {"host": socket.gethostname(), "pid": dead.pid, "time": time.time()},
        {"host": "another-node", "pid": 1, "time": time.time() - shared_files.LOCK_STALE_S - 1},
    ):
        lock.write_text(json.dumps(holder))
        with shared_files.exclusive_lock(lock):
            assert json.loads(lock.read_text())["pid"] == os.getpid()

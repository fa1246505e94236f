"""cli: the stale-lock housekeeping a killed driver needs, on synthetic records (no Snakemake run)."""

from __future__ import annotations

import json
import socket
import subprocess

import psutil
import pytest

from tula_hpc import cli


def _locked(tmp_path, **driver) -> None:
    (tmp_path / ".snakemake" / "locks").mkdir(parents=True)
    (tmp_path / ".snakemake" / "locks" / "0.input.lock").write_text("")
    (tmp_path / cli.DRIVER_RECORD).write_text(json.dumps(driver))


def _gone_process() -> dict:
    proc = subprocess.Popen(["true"])
    created = psutil.Process(proc.pid).create_time()
    proc.wait()
    return {"host": socket.gethostname(), "pid": proc.pid, "created": created}


@pytest.mark.spawns
def test_the_lock_of_a_driver_that_is_gone_is_removed(tmp_path):
    _locked(tmp_path, **_gone_process())
    assert cli.remove_stale_lock(tmp_path)
    assert not any((tmp_path / ".snakemake" / "locks").iterdir())


@pytest.mark.spawns
def test_the_lock_of_a_live_driver_or_another_hosts_is_kept(tmp_path):
    cli.record_driver(tmp_path)  # this process: alive
    driver = json.loads((tmp_path / cli.DRIVER_RECORD).read_text())
    (tmp_path / ".snakemake" / "locks").mkdir()
    (tmp_path / ".snakemake" / "locks" / "0.input.lock").write_text("")
    assert not cli.remove_stale_lock(tmp_path)
    (tmp_path / cli.DRIVER_RECORD).write_text(json.dumps({**_gone_process(), "host": "login2"}))
    assert not cli.remove_stale_lock(tmp_path)  # on a shared file system another host's driver may live
    assert driver["pid"] == psutil.Process().pid and any((tmp_path / ".snakemake" / "locks").iterdir())


def test_a_reused_pid_is_not_taken_for_the_driver(tmp_path):
    """The recorded pid now belongs to another process (this one, started at another time): the lock is stale."""
    me = psutil.Process()
    _locked(tmp_path, host=socket.gethostname(), pid=me.pid, created=me.create_time() - 3600)
    assert cli.remove_stale_lock(tmp_path)


def test_no_lock_or_no_record_leaves_everything_as_it_is(tmp_path):
    assert not cli.remove_stale_lock(tmp_path)
    (tmp_path / ".snakemake" / "locks").mkdir(parents=True)
    (tmp_path / ".snakemake" / "locks" / "0.input.lock").write_text("")
    assert not cli.remove_stale_lock(tmp_path)  # a lock of a driver that recorded nothing (an older version)

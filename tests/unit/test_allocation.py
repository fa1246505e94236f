"""allocation: the measuring phase's holder job asked for, kept and given back, against fake Slurm commands."""

from __future__ import annotations

import dataclasses
import fcntl
import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import fake_commands as _fake_commands
from tests.unit.test_shared_allocation_launcher import PARTITION, shared_spec
from tula_hpc.cluster import allocation, slurm_states
from tula_hpc.cluster.launch_spec import LaunchSpec
from tula_hpc.core.job import SlurmSettings


def test_the_allocation_asks_slurm_for_the_phases_time_and_memory_not_one_steps():
    holder = allocation.holder_command(shared_spec(Path("/w"), nodes=2), "job-allocation", 2)
    assert holder[:4] == ["sbatch", "--parsable", "--job-name=job-allocation", "--nodes=2"]
    assert {"--time=60", "--partition=debug", "--mem=1024M"} <= set(holder)
    assert holder[-2:] == ["--wrap", "exec sleep infinity"]


def test_the_allocation_asks_for_the_sites_gpu_type_for_every_node():
    spec = shared_spec(Path("/w"), nodes=2)
    spec = dataclasses.replace(
        spec,
        slurm=SlurmSettings(gpu_type="a100", reservation="maint"),
        allocation=dataclasses.replace(spec.allocation, gpus_per_node=4),
    )
    holder = allocation.holder_command(spec, "job-allocation", 2)
    assert {"--gpus-per-node=a100:4", "--ntasks-per-node=4", "--reservation=maint", "--requeue"} <= set(holder)
    assert sum(word.startswith("--gpus") for word in holder) == 1


@pytest.mark.spawns
def test_the_allocation_is_asked_for_once_and_replaced_when_it_ended(tmp_path, monkeypatch):
    state = tmp_path / "state"
    state.write_text("RUNNING")
    log = _fake_commands(
        tmp_path,
        monkeypatch,
        sbatch="echo 77",
        squeue=f"cat {state}",
        scancel="exit 0",
        sacct="echo CANCELLED",
        scontrol=f"echo '{PARTITION}'",
    )
    spec = shared_spec(tmp_path)
    assert allocation.hold_allocation(spec) == "77" and allocation.hold_allocation(spec) == "77"
    assert sum(line.startswith("sbatch") for line in log.read_text().splitlines()) == 1
    state.write_text("")  # squeue forgot it: accounting says it ended
    monkeypatch.setattr(slurm_states, "ACCOUNTING_LAG_S", 0.05)
    (tmp_path / "bin" / "sbatch").write_text(f'#!/bin/sh\necho "sbatch $*" >>{log}\necho 78\nprintf RUNNING >{state}\n')
    assert allocation.hold_allocation(spec) == "78"
    assert allocation.release_allocation(tmp_path / "work") and not allocation.release_allocation(tmp_path / "work")
    assert log.read_text().splitlines()[-1] == "scancel 78"


def _spec_with_recorded_allocation(tmp_path: Path, job_id: str) -> LaunchSpec:
    """A measurement's spec whose folder already records a 2-node allocation `job_id`, as an earlier stage left it."""
    spec = shared_spec(tmp_path)
    folder = Path(spec.allocation.folder)
    folder.mkdir(parents=True)
    (folder / "allocation.json").write_text(json.dumps({"job_id": job_id, "nodes": 2, "asked": 0}))
    return spec


@pytest.mark.spawns
def test_a_recorded_allocation_is_kept_while_slurmctld_does_not_answer(tmp_path, monkeypatch):
    """slurmctld restarts: squeue and sacct fail. The allocation is not cancelled on missing information, nor a
    second one asked for; its state is asked again until slurmctld answers."""
    count, away = tmp_path / "count", 'echo "Unable to contact slurm controller" >&2; exit 1'
    log = _fake_commands(
        tmp_path,
        monkeypatch,
        sbatch="echo 78",
        squeue=f'echo x >>{count}; [ "$(wc -l <{count})" -le 2 ] && {{ {away}; }}; echo RUNNING',
        sacct=away,
        scancel="exit 0",
        scontrol=f"echo '{PARTITION}'",
    )
    monkeypatch.setattr(slurm_states, "BACKOFF_FIRST_S", 0.01)
    spec = _spec_with_recorded_allocation(tmp_path, "77")
    assert allocation.hold_allocation(spec) == "77"
    assert not any(line.startswith(("scancel", "sbatch")) for line in log.read_text().splitlines())


@pytest.mark.spawns
def test_an_allocation_held_by_an_administrator_is_waited_on_with_backoff_and_never_cancelled(
    tmp_path, monkeypatch, capsys
):
    """JobHeldAdmin while pending (four polls, each pause twice the last), then released and running; fcntl.flock
    refuses to lock (Lustre without flock): the lock does not need it."""
    count, pauses = tmp_path / "count", []
    state = f'echo x >>{count}; [ "$(wc -l <{count})" -le 4 ] && echo PENDING || echo RUNNING'
    log = _fake_commands(
        tmp_path,
        monkeypatch,
        sbatch="echo 77",
        squeue=f'case "$*" in *%r*) echo JobHeldAdmin;; *) {state};; esac',
        scancel="exit 0",
        scontrol=f"echo '{PARTITION}'",
    )

    def refused(*args):
        raise OSError(37, "No locks available")

    monkeypatch.setattr(fcntl, "flock", refused)
    monkeypatch.setattr(allocation, "time", SimpleNamespace(time=time.time, sleep=pauses.append))
    assert allocation.hold_allocation(shared_spec(tmp_path)) == "77"
    assert "scancel" not in log.read_text() and pauses == [2, 4, 8, 16]
    assert capsys.readouterr().out.count("pends: JobHeldAdmin") == 1


@pytest.mark.spawns
def test_an_allocation_being_preempted_is_waited_out_never_cancelled_and_replaced(tmp_path, monkeypatch):
    """PreemptMode=CANCEL: the recorded allocation runs on for its GraceTime. A new step there would die; cancelled,
    it would end CANCELLED, which the stages of its other steps take for a person's cancel. So it is waited out
    (it ends PREEMPTED) and a new one asked for."""
    count, preempted = tmp_path / "count", "JobId=77 PreemptTime=2026-11-28T08:55:40"
    gone = f'echo x >>{count}; [ "$(wc -l <{count})" -le 3 ] && echo RUNNING; exit 0'
    log = _fake_commands(
        tmp_path,
        monkeypatch,
        sbatch="echo 78",
        squeue=f'case "$*" in *" 78 "*|*"-j 78"*) echo RUNNING;; *) {gone};; esac',
        sacct="echo PREEMPTED",
        scancel="exit 0",
        scontrol=f'case "$*" in *"show job"*) echo "{preempted}";; *) echo \'{PARTITION}\';; esac',
    )
    monkeypatch.setattr(slurm_states, "BACKOFF_FIRST_S", 0.01)
    spec = _spec_with_recorded_allocation(tmp_path, "77")
    assert allocation.hold_allocation(spec) == "78"
    assert not any(line.startswith("scancel") for line in log.read_text().splitlines())

"""bench/chaos_site_faults.py's faults where they need no cluster: against fake Slurm commands and a stand-in
driver, with known answers."""

from __future__ import annotations

import os
import time

import pytest
from tula_bench import chaos_site_faults as faults

from tests.conftest import fake_commands


class Driver:
    """A run that never ends by itself; each look at it also runs `watch` (what the fault has done meanwhile)."""

    def __init__(self, watch=lambda: None):
        self.watch, self.seen = watch, []

    def poll(self):
        self.seen.append(self.watch())


def test_a_fresh_result_is_hidden_for_the_lag_and_put_back(tmp_path, monkeypatch):
    monkeypatch.setattr(faults, "LAG_S", 0.3)
    folder = tmp_path / "work" / "c1" / "train" / "submitit"
    folder.mkdir(parents=True)
    old, fresh = folder / "11_0_result.pkl", folder / "12_0_result.pkl"
    old.write_bytes(b"read long ago")
    os.utime(old, (time.time() - 60, time.time() - 60))
    fresh.write_bytes(b"result")
    driver = Driver(watch=fresh.exists)
    where = faults.late_results(driver, tmp_path, "c1", at=time.time() - 5, started=time.time() - 30)
    assert where["file"] == "work/c1/train/submitit/12_0_result.pkl"  # not the one written before the moment
    assert driver.seen[0] and len(driver.seen) > 1 and not any(driver.seen[1:])  # seen, then hidden while it lasted
    assert fresh.read_bytes() == b"result" and not list(folder.glob(".*"))  # back, nothing left aside


def test_the_preempted_job_is_the_measuring_one_only_while_a_profile_runs(tmp_path):
    profile = tmp_path / "work" / "c1" / "profile" / "N1_B32"
    assert not faults.profiling_job(tmp_path, "c1", "c1-allocation")
    profile.mkdir(parents=True)
    assert faults.profiling_job(tmp_path, "c1", "c1-allocation")
    assert faults.profiling_job(tmp_path, "c1", "c1-profile-N1-B32")  # its own job (allocation: per_stage)
    assert not faults.profiling_job(tmp_path, "c1", "c1-train") and faults.training_job(tmp_path, "c1", "c1-train")
    (tmp_path / "results" / "c1" / "profile").mkdir(parents=True)
    (tmp_path / "results" / "c1" / "profile" / "N1_B32.json").write_text("{}")
    assert not faults.profiling_job(tmp_path, "c1", "c1-allocation")  # done: the allocation is between profiles


@pytest.mark.spawns
@pytest.mark.parametrize("ends", ["PENDING", "CANCELLED"])
def test_a_held_job_is_released_after_the_hold_and_counted_when_it_was_cancelled_first(tmp_path, monkeypatch, ends):
    monkeypatch.setattr(faults, "HOLD_S", 0.2)
    state = tmp_path / "state"
    state.write_text(ends)
    log = fake_commands(
        tmp_path,
        monkeypatch,
        sinfo="printf 'node1\\nnode2\\nnode1\\n'",  # a node in two partitions is listed twice
        sbatch="echo 90",
        squeue=f'case "$*" in *PENDING*) echo "55 c1-train";; *) cat {state};; esac',
        scontrol="exit 0",
        scancel="exit 0",
    )
    where = faults.admin_hold(Driver(), tmp_path, "c1", at=time.time(), started=time.time() - 10)
    assert (where["job"], where["held"], where["held_cancelled"]) == ("c1-train", True, ends == "CANCELLED")
    calls = log.read_text().splitlines()
    blockers = [call for call in calls if call.startswith("sbatch")]
    assert len(blockers) == 2 and all("--job-name=chaos-blocker-c1" in call for call in blockers)
    assert "--nodelist=node1" in blockers[0] and "--nodelist=node2" in blockers[1]
    hold, release = calls.index("scontrol hold 55"), calls.index("scontrol release 55")
    assert hold < calls.index("scancel 90") < release  # the nodes are freed while the job is held

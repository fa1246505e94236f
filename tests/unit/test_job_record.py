"""launchers/job_record: the job recorded beside the stage's work before it starts, and re-attached by a rerun with
the launcher that started it.

No cluster: fake `sbatch`, `squeue` and `srun` on PATH stand in for Slurm (as in submitit's own tests).
"""

from __future__ import annotations

import json
import subprocess

import psutil
import pytest
from submitit.core.utils import cloudpickle_dump

from tests.conftest import fake_commands as _fake_commands
from tests.unit.test_shared_allocation_launcher import PARTITION, answer, shared_spec
from tula_hpc.cluster import launch
from tula_hpc.cluster.launch_spec import LaunchSpec
from tula_hpc.cluster.launchers.registry import LAUNCHERS


@pytest.mark.spawns
def test_a_reattached_step_is_waited_for_as_a_step_whatever_the_spec_says_now(tmp_path, capsys):
    """A step of a shared allocation, still running when the stage is rerun with allocation per_stage: it is waited
    for and its result read as a step's (no sbatch job of that id to ask Slurm about)."""
    stage_dir, folder = tmp_path / "profile", tmp_path / "profile" / "submit-x"
    folder.mkdir(parents=True)
    cloudpickle_dump(("success", 5), folder / "77_0_result.pkl")
    step = subprocess.Popen(["sleep", "0.3"])
    srun = [step.pid, psutil.Process(step.pid).create_time()]
    record = {"launcher": "slurm_shared", "name": "profile", "srun": srun, "job_id": "77", "folder": str(folder)}
    record["tasks"] = 1
    (stage_dir / "job.json").write_text(json.dumps(record))
    assert launch.run(answer, {"value": 0}, LaunchSpec("slurm"), stage_dir, name="profile") == 5
    assert "re-attached to slurm_shared job 77" in capsys.readouterr().out
    step.wait()


@pytest.mark.spawns
def test_the_job_is_recorded_before_it_starts_so_a_driver_killed_as_it_starts_leaves_a_record(tmp_path, monkeypatch):
    """A driver killed after srun started a step and before it wrote the step's record: the rerun found no record
    and measured again beside the orphan (CI saw a profile run twice). The record is written first, with the
    allocation's id; the rerun finds the step by its name in the allocation and waits for it."""
    squeue = 'case "$*" in *" -s "*) exit 0;; *) echo RUNNING;; esac'  # the allocation runs, the step has ended
    log = _fake_commands(
        tmp_path, monkeypatch, sbatch="echo 77", squeue=squeue, srun="exit 1", scontrol=f"echo '{PARTITION}'"
    )
    spec, stage_dir = shared_spec(tmp_path), tmp_path / "profile"
    shared = LAUNCHERS["slurm_shared"]

    def killed_as_it_starts(spec, folder, name, task, job_id_ahead=None):
        recorded = json.loads((stage_dir / "job.json").read_text())
        assert (recorded["job_id"], recorded["name"], recorded.get("srun")) == ("77", "job-profile", None)
        assert recorded["folder"] == str(folder.resolve())
        folder.mkdir(parents=True)
        cloudpickle_dump(("success", 5), folder / "77_0_result.pkl")  # the orphan step measures
        raise KeyboardInterrupt

    monkeypatch.setattr(shared, "submit", killed_as_it_starts)
    with pytest.raises(KeyboardInterrupt):
        launch.run(answer, {"value": 0}, spec, stage_dir, name="job-profile")
    monkeypatch.setattr(shared, "submit", type(shared).submit.__get__(shared))
    assert launch.run(answer, {"value": 0}, spec, stage_dir, name="job-profile") == 5
    assert "srun" not in log.read_text()  # not measured again

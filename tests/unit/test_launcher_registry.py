"""launchers/registry: which launcher runs a job, by the name the profile and job.json give it."""

from __future__ import annotations

from pathlib import Path

from tests.unit.test_shared_allocation_launcher import shared_spec
from tula_hpc.cluster.launch_spec import LaunchSpec
from tula_hpc.cluster.launchers.registry import LAUNCHERS, launcher_for


def test_each_launcher_is_found_by_its_own_name():
    assert {name: launcher.name for name, launcher in LAUNCHERS.items()} == {
        "local": "local",
        "slurm": "slurm",
        "slurm_shared": "slurm_shared",
    }


def test_a_measurement_in_the_shared_allocation_runs_as_its_step_and_any_other_job_as_the_profile_says():
    assert launcher_for(shared_spec(Path("/w"))) is LAUNCHERS["slurm_shared"]
    assert launcher_for(LaunchSpec("slurm")) is LAUNCHERS["slurm"]
    assert launcher_for(LaunchSpec("local")) is LAUNCHERS["local"]

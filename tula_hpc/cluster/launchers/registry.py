"""Which launcher runs a job: the profile's launcher name (`local`, `slurm`), or `slurm_shared` for a measurement in
the shared allocation. job.json records a job's launcher by the same name, so a rerun re-attaches with the launcher
that started the job, whatever the settings say now."""

from __future__ import annotations

from tula_hpc.cluster.launch_spec import LaunchSpec
from tula_hpc.cluster.launchers.interface import Launcher
from tula_hpc.cluster.launchers.local import LocalLauncher
from tula_hpc.cluster.launchers.shared_allocation import SharedAllocationLauncher
from tula_hpc.cluster.launchers.slurm import SlurmLauncher

LAUNCHERS: dict[str, Launcher] = {
    launcher.name: launcher for launcher in (LocalLauncher(), SlurmLauncher(), SharedAllocationLauncher())
}


def launcher_for(spec: LaunchSpec) -> Launcher:
    return LAUNCHERS["slurm_shared" if spec.allocation else spec.launcher]

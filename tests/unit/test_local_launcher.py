"""launchers/local: N "nodes" as N processes of one submitit local job."""

from __future__ import annotations

import pytest

from tula_hpc.cluster.launch_spec import LaunchSpec
from tula_hpc.cluster.launchers.local import LocalLauncher


@pytest.mark.parametrize(("nodes", "gpus", "visible"), [(2, 1, "0,1"), (2, 2, "0,1,2,3"), (2, 0, "")])
def test_the_local_launcher_shows_each_rank_a_gpu_of_its_own(tmp_path, nodes, gpus, visible):
    """submitit's local executor makes GPUs 0 to gpus_per_node - 1 visible to all its processes: the N "nodes"
    it runs need the GPUs of them all, or ranks beyond the first node's find none."""
    executor = LocalLauncher().executor(LaunchSpec("local", nodes=nodes, gpus_per_node=gpus), tmp_path, "train")
    shown = executor._executor.parameters["gpus_per_node"]
    assert ",".join(map(str, range(shown))) == visible


def test_a_local_job_whose_driver_died_before_recording_its_id_is_not_reattached(tmp_path):
    """A local job dies with its driver: there is nothing to wait for."""
    record = {"launcher": "local", "name": "job-train", "job_id": None, "folder": str(tmp_path), "tasks": 1}
    assert LocalLauncher().reattach(record) is None

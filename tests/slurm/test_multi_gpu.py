"""`gpus_per_node > 1` through real Slurm: one rank per GPU, LOCAL_RANK picks the device.

The local cluster's GPUs are stand-ins (scripts/slurm/README.md): Slurm schedules them and sets
CUDA_VISIBLE_DEVICES, but torch finds no CUDA here, so every rank computes on the CPU.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.conftest import wait_for
from tests.slurm.workers import gpu_rank_on_a_node_without_cuda, report_ranks
from tula_hpc.cluster import launch, slurm_states
from tula_hpc.core.atomic_files import read_json

pytestmark = pytest.mark.slurm


def _alloc_tres(job_id: str) -> str:
    """What accounting says the allocation got ("billing=4,cpu=4,gres/gpu=4,..."), once it knows."""
    out = subprocess.run(
        ["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "AllocTRES"], capture_output=True, text=True, check=True
    ).stdout
    return out.strip()


def test_two_gpus_per_node_run_two_ranks_per_node_one_per_gpu(slurm_cluster, tmp_path):
    spec = launch.LaunchSpec(launcher="slurm", nodes=2, gpus_per_node=2, mem_gb=2, time_min=5)
    ranks = launch.run(report_ranks, {}, spec, tmp_path, name="multi-gpu")

    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    assert {r["world_size"] for r in ranks} == {4}
    assert {r["sum"] for r in ranks} == {1.0 + 2 + 3 + 4}
    assert {r["env"]["MASTER_ADDR"] for r in ranks} == {"node1"}  # the allocation's first node
    by_node: dict[int, list[dict]] = {}
    for r in ranks:
        by_node.setdefault(r["node_id"], []).append(r)
        assert r["env"]["RANK"] == str(r["rank"]) and r["env"]["LOCAL_RANK"] == str(r["local_rank"])
        # Slurm gives every task of a node all of its GPUs: cuda:LOCAL_RANK is the rank's own
        assert r["cuda_visible_devices"] == "0,1"
        assert r["device"] == "cpu"  # no CUDA on this machine
    assert sorted(by_node) == [0, 1]
    for node_ranks in by_node.values():
        assert sorted(r["local_rank"] for r in node_ranks) == [0, 1]
        assert len({r["host"] for r in node_ranks}) == 1

    record = read_json(tmp_path / "job.json")
    job_id = record["job_id"]
    script = (Path(record["folder"]) / f"{job_id}_submission.sh").read_text()
    assert "#SBATCH --gpus-per-node=2\n" in script and "#SBATCH --ntasks-per-node=2\n" in script
    # launch.run returns once every rank has left its result; the ranks' exit (gloo teardown) takes a moment more
    ended = wait_for(
        lambda: (state := slurm_states.slurm_state(job_id)) not in slurm_states.ACTIVE_SLURM_STATES and state,
        60,
        "the job's end",
    )
    assert ended == "COMPLETED"
    tres = wait_for(lambda: "gres/gpu" in _alloc_tres(job_id) and _alloc_tres(job_id), 30, "sacct's AllocTRES")
    assert "gres/gpu=4" in tres.split(","), tres


def test_a_gpu_job_on_a_node_without_usable_cuda_stops_there_and_says_why(slurm_cluster, tmp_path):
    """Checked where the job runs (a login node has no GPU to ask): the rank names its host, the wheel's CUDA and
    the driver, and never computes on the CPU in the GPU's stead."""
    spec = launch.LaunchSpec(launcher="slurm", nodes=1, gpus_per_node=1, mem_gb=2, time_min=5)
    with pytest.raises(launch.JobFailed) as failed:
        launch.run(gpu_rank_on_a_node_without_cuda, {}, spec, tmp_path, name="no-cuda")
    message = str(failed.value)
    assert "DeviceError" in message and "finds CUDA unusable (host node1: torch" in message
    assert "NVIDIA driver not found" in message

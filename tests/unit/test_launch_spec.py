"""launch_spec: what a stage's job asks for, built from a job's resources."""

from __future__ import annotations

from dataclasses import replace

from tests.conftest import default_job
from tula_hpc.cluster.launch_spec import LaunchSpec
from tula_hpc.core.job import Job


def _slurm_gpu_job() -> Job:
    """A Slurm job on nodes of 4 GPUs."""
    resources = {"gpus_per_node": 4, "cpus_per_task": 8, "mem_gb": 32, "time_min": 60, "max_requeues": 3}
    return default_job().updated(launcher="slurm", resources=resources)


def test_one_device_keeps_at_most_one_gpu_per_node():
    job = _slurm_gpu_job()
    assert LaunchSpec.for_job(job, nodes=2).world_size == 8
    one = LaunchSpec.for_job(job, nodes=2, one_device=True)
    assert (one.gpus_per_node, one.world_size, one.cpus_per_task) == (1, 2, 8)
    cpu_job = job.updated(resources={"gpus_per_node": 0})
    assert LaunchSpec.for_job(cpu_job, one_device=True).gpus_per_node == 0


def test_a_candidates_own_gpus_per_node_sets_the_ranks_on_each_node():
    """A node shape of 2 GPUs on nodes of 4 (search.gpus_per_node): Slurm is asked for 2 tasks and 2 GPUs each."""
    job = _slurm_gpu_job()
    spec = LaunchSpec.for_job(job, nodes=2, gpus_per_node=2)
    assert (spec.gpus_per_node, spec.tasks_per_node, spec.world_size) == (2, 2, 4)
    assert LaunchSpec.for_job(job, nodes=2, gpus_per_node=2, one_device=True).world_size == 2


def test_every_rank_exports_the_sites_environment_beside_the_allocators():
    network = {"NCCL_SOCKET_IFNAME": "ib0", "GLOO_SOCKET_IFNAME": "ib0", "NCCL_IB_HCA": "mlx5_0"}
    job = _slurm_gpu_job().updated(resources={"slurm": {"environment": network}, "cuda_alloc_conf": "backend:native"})
    assert LaunchSpec.for_job(job).environment == {**network, "PYTORCH_CUDA_ALLOC_CONF": "backend:native"}


def test_the_warning_before_the_time_limit_is_the_measured_one_else_a_quarter_of_short_limits_up_to_90_s():
    job = _slurm_gpu_job()
    spec = LaunchSpec.for_job(job)
    assert spec.stop_warning_s is None and spec.warning_before_limit_s == 90  # 60 minutes: 90 s
    assert replace(spec, time_min=4).warning_before_limit_s == 60  # a quarter of 4 minutes
    assert replace(spec, stop_warning_s=240).warning_before_limit_s == 240
    local = LaunchSpec.for_job(job.updated(launcher="local"))
    assert replace(local, stop_warning_s=240).warning_before_limit_s is None  # no time limit, no warning

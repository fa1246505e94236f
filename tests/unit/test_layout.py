"""How ranks and samples are laid out: hosts shared, steps per epoch."""

from tests.conftest import default_job
from tula_hpc.core.run_layout import (
    candidate_devices,
    devices_per_node,
    doublings,
    last_batch,
    node_shape,
    profile_name,
    ranks_per_host,
    steps_per_epoch,
)


def test_a_grid_axis_is_the_minimum_and_its_doublings_up_to_the_maximum():
    assert doublings(64, 300) == [64, 128, 256] and doublings(4, 4) == [4] and doublings(8, 4) == []


def test_a_node_runs_one_rank_per_gpu_or_one_cpu_rank():
    # a cluster's node (no GPU asked for here)
    assert devices_per_node(default_job().updated(resources={"gpus_per_node": 4})) == 4
    assert devices_per_node(default_job(resources={"gpus_per_node": 0})) == 1


def test_local_ranks_share_one_host_and_cluster_ranks_share_a_node():
    assert ranks_per_host("local", nodes=4, devices_per_node=2) == 8
    assert ranks_per_host("slurm", nodes=4, devices_per_node=2) == 2


def test_steps_per_epoch_follow_distributed_sampler_and_the_last_step_takes_the_rest():
    # 1000 samples over 2 ranks: 500 each; in batches of 30 that is 16 full steps and a last one of 20.
    assert steps_per_epoch(1000, 2, 30) == 17 and last_batch(1000, 2, 30) == 20
    # 1001 samples: DistributedSampler pads each rank's share to 501.
    assert steps_per_epoch(1001, 2, 501) == 1 and last_batch(1001, 2, 501) == 501


def test_a_candidate_runs_on_its_own_gpus_per_node_and_profiles_at_another_get_their_own_name():
    job = default_job().updated(resources={"gpus_per_node": 4})
    assert candidate_devices({"nodes": 2, "gpus_per_node": 2}, job) == 2
    assert candidate_devices({"nodes": 2}, job) == 4  # a plan made before GPUs per node was a choice
    assert candidate_devices({"nodes": 2, "gpus_per_node": 0}, default_job()) == 1
    assert profile_name({"nodes": 2, "gpus_per_node": 4, "batch": 64}, job) == "N2_B64"  # as before
    assert profile_name({"nodes": 2, "gpus_per_node": 2, "batch": 64}, job) == "N2_G2_B64"
    assert node_shape({"nodes": 2, "gpus_per_node": 2}) == "2 node(s) x 2 GPU(s)"
    assert node_shape({"nodes": 2, "gpus_per_node": 0}, "N={}") == "N=2"

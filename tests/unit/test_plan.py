"""Stage plan: the candidate grid of (nodes, global batch)."""

import json
from dataclasses import replace

import pytest

from tests.conftest import default_job
from tula_hpc import plan as plan_stage
from tula_hpc.cluster.partition import PartitionLimits
from tula_hpc.core.errors import StageError
from tula_hpc.core.job import SearchSettings, Span
from tula_hpc.stages.plan import candidate_grid


def search_over(nodes: tuple, batch: tuple, gpus: tuple = (1, 1)) -> SearchSettings:
    """The default job's search over these (min, max) ranges of nodes, global batches and GPUs per node."""
    return replace(default_job().search, nodes=Span(*nodes), batch=Span(*batch), gpus_per_node=Span(*gpus))


SEARCH = search_over(nodes=(1, 4), batch=(32, "auto"))


def test_grid_doubles_nodes_and_batches_within_memory_and_data():
    grid = candidate_grid(SEARCH, max_batch_per_device=64, train_samples=10_000)
    pairs = {(c["nodes"], c["batch"]) for c in grid}
    assert pairs == {(1, 32), (1, 64), (2, 32), (2, 64), (2, 128), (4, 32), (4, 64), (4, 128), (4, 256)}
    assert all(c["per_device_batch"] * c["nodes"] == c["batch"] for c in grid)


def test_grid_respects_explicit_max_devices_and_training_set():
    search = search_over(nodes=(2, 2), batch=(16, 1024), gpus=(4, 4))
    grid = candidate_grid(search, max_batch_per_device=1000, train_samples=300)
    assert [c["batch"] for c in grid] == [16, 32, 64, 128, 256]
    assert [c["per_device_batch"] for c in grid] == [2, 4, 8, 16, 32]


def test_grid_varies_gpus_per_node_over_doublings_and_the_maximum():
    search = search_over(nodes=(1, 2), batch=(48, "auto"), gpus=(1, 3))
    grid = candidate_grid(search, max_batch_per_device=64, train_samples=10_000)
    assert sorted({c["gpus_per_node"] for c in grid}) == [1, 2, 3]
    for c in grid:  # B splits over the N x g ranks and fits a device
        assert c["per_device_batch"] * c["nodes"] * c["gpus_per_node"] == c["batch"] and c["per_device_batch"] <= 64
    # 1 node x 2 GPUs and 2 nodes x 1 GPU: the same ranks and batches, different candidates.
    shapes = {(c["nodes"], c["gpus_per_node"]) for c in grid if c["batch"] == 96}
    assert shapes == {(1, 2), (1, 3), (2, 1), (2, 2), (2, 3)}
    assert max(c["batch"] for c in grid if c["nodes"] == 2 and c["gpus_per_node"] == 3) == 384


def test_a_cpu_grid_marks_every_candidate_with_no_gpu():
    search = replace(SEARCH, gpus_per_node=Span(0, 0))
    grid = candidate_grid(search, max_batch_per_device=64, train_samples=10_000)
    assert {c["gpus_per_node"] for c in grid} == {0}
    assert {(c["nodes"], c["batch"]) for c in grid} == {
        (c["nodes"], c["batch"]) for c in candidate_grid(SEARCH, 64, 10_000)
    }


def test_on_slurm_the_partition_bounds_the_grid_naming_its_limits(tmp_path, monkeypatch):
    memory = tmp_path / "memory.json"
    memory.write_text(json.dumps({"max_batch_per_device": 64, "dataset": {"train": 1000}}))
    job = default_job(search={"nodes": {"min": 1, "max": 4}}).updated(launcher="slurm")
    limits = PartitionLimits(partition="debug", nodes=4, max_nodes=2)
    monkeypatch.setattr(plan_stage, "partition_limits", lambda name: limits)
    result = plan_stage.plan(job, memory, tmp_path / "plan.json")
    assert {c["nodes"] for c in result["candidates"]} == {1, 2}
    assert result["partition"]["max_nodes"] == 2
    assert {c["nodes"] for c in result["partition"]["excluded"]} == {4}
    assert result["partition"]["excluded"][0]["breaks"] == ["4 nodes > partition debug's MaxNodes=2"]
    job = default_job(search={"nodes": {"min": 4, "max": 4}}).updated(launcher="slurm")
    with pytest.raises(StageError, match="partition debug can run none of the candidates: 4 nodes > partition debug"):
        plan_stage.plan(job, memory, tmp_path / "plan.json")

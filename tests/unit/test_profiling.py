"""Stage profile: submits the timed steps (step_timing) at a planned configuration and writes what they measured."""

import json
import os

import pytest
import torch
import yaml

from tests.conftest import default_job, job_config
from tula_hpc.core.errors import StageError
from tula_hpc.performance import prediction
from tula_hpc.profiling import step_timing
from tula_hpc.stages import profile as profiling


@pytest.fixture
def job():
    return default_job()


class _RankEnded(Exception):
    """os._exit, as end_job_step ends the rank, without ending pytest."""


@pytest.mark.parametrize(
    "error",
    [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), RuntimeError("CUDA out of memory.")],
)
def test_a_profile_that_runs_out_of_memory_is_a_clear_stage_error(job, tmp_path, monkeypatch, error):
    """The failing rank records it and ends the job step; the stage names the job, the configuration, the memory
    model's largest batch and what to do, however the backend ended the other ranks."""

    def measure_out_of_memory(*args, **kwargs):
        raise error

    def end_rank(code):
        raise _RankEnded(code)

    def run_one_rank(fn, kwargs, spec, folder, name):
        with pytest.raises(_RankEnded):
            fn(**kwargs)
        raise profiling.launch.JobFailed(f"{name}: a rank exited with code 3")

    monkeypatch.setattr(step_timing, "measure", measure_out_of_memory)
    monkeypatch.setattr(os, "_exit", end_rank)
    monkeypatch.setattr(profiling.launch, "run", run_one_rank)
    plan = tmp_path / "plan.json"
    plan.write_text('{"profile": [{"nodes": 1, "batch": 64}], "max_batch_per_device": 48}')
    with pytest.raises(StageError) as failure:
        profiling.profile(job, plan, 1, 64, tmp_path / "N1_B64.json", tmp_path / "work")
    message = str(failure.value)
    assert "job 'digits-cnn': the profile at nodes=1, global batch 64 (64 per device) ran out of memory" in message
    assert "allows up to 48 per device" in message and "out of memory" in message.split("Error: ")[1]
    assert all(advice in message for advice in ("probe_memory", "resources.memory_headroom", "search.batch.max"))
    assert not (tmp_path / "N1_B64.json").exists()


def test_a_profile_that_fails_otherwise_is_not_taken_for_running_out_of_memory(job, tmp_path, monkeypatch):
    def run_failing(fn, kwargs, spec, folder, name):
        raise profiling.launch.JobFailed(f"{name}: node lost")

    monkeypatch.setattr(profiling.launch, "run", run_failing)
    plan = tmp_path / "plan.json"
    plan.write_text('{"profile": [{"nodes": 1, "batch": 64}], "max_batch_per_device": 48}')
    with pytest.raises(profiling.launch.JobFailed, match="node lost"):
        profiling.profile(job, plan, 1, 64, tmp_path / "N1_B64.json", tmp_path / "work")


@pytest.fixture
def gpu_job(job):
    """The default job on Slurm nodes of 4 GPUs, each candidate choosing how many of them to use."""
    return job.updated(launcher="slurm", resources={"gpus_per_node": 4})


@pytest.fixture
def launched(monkeypatch):
    """Profile jobs as launched (spec, folder, name), each returning a record of the ranks it ran."""
    runs = []

    def run(fn, kwargs, spec, folder, name):
        runs.append((spec, folder, name))
        return {"world_size": spec.world_size, "global_batch": kwargs["global_batch"]}, None

    monkeypatch.setattr(profiling.launch, "run_or_out_of_memory", run)
    return runs


def _plan(path, candidates):
    path.write_text(json.dumps({"candidates": candidates, "profile": candidates[:1], "max_batch_per_device": 64}))
    return path


def test_a_profile_at_other_gpus_per_node_launches_that_many_ranks_and_records_them(gpu_job, launched, tmp_path):
    plan = _plan(tmp_path / "plan.json", [{"nodes": 2, "gpus_per_node": 2, "batch": 64}])
    config = tmp_path / "jobs.yaml"
    config.write_text(yaml.safe_dump(job_config(resources={"gpus_per_node": 4, "mem_gb": 16})))
    out = tmp_path / "N2_G2_B64.json"
    argv = ["--config", str(config), "--job", "digits-cnn", "--launcher", "slurm", "--work-dir", str(tmp_path)]
    argv += ["--plan", str(plan), "--nodes", "2", "--gpus-per-node", "2", "--batch", "64", "--out", str(out)]
    assert profiling.main(argv) == 0
    [(spec, folder, name)] = launched
    assert (spec.nodes, spec.tasks_per_node, spec.world_size) == (2, 2, 4)
    assert folder.name == "N2_G2_B64" and name == "digits-cnn-profile-N2-G2-B64"
    assert json.loads(out.read_text())["gpus_per_node"] == 2
    with pytest.raises(StageError, match=r"\(nodes=2, gpus_per_node=4, batch=64\) is not in the plan"):
        profiling.profile(gpu_job, plan, 2, 64, tmp_path / "N2_B64.json", tmp_path / "work")


def test_adaptive_search_keeps_each_node_shape_under_its_own_name(gpu_job, launched, tmp_path, monkeypatch):
    candidates = [{"nodes": 2, "gpus_per_node": g, "batch": 64, "per_device_batch": 64 // (2 * g)} for g in (4, 2)]
    plan = _plan(tmp_path / "plan.json", candidates)
    planned = tmp_path / "N2_B64.json"
    planned.write_text(json.dumps({"nodes": 2, "gpus_per_node": 4, "global_batch": 64, "world_size": 8}))

    def search(grid, initial, measure, row_of, *settings):
        profiles = [measure(c) for c in grid]
        assert [row_of(c) for c in grid] == [[8, 8, 4], [4, 16, 2]]
        return {"profiled": grid, "profiles": profiles, "history": [], "discrepancy_per_octave": 0.02, "stopped": "-"}

    monkeypatch.setattr(profiling, "adaptive_search", search)
    job = gpu_job.updated(search={"mode": "adaptive", "confirm": 0})
    manifest = profiling.adapt(job, plan, None, [planned], tmp_path / "adaptive.json", tmp_path / "work")
    assert [(spec.nodes, spec.tasks_per_node) for spec, _, _ in launched] == [(2, 2)]  # the planned one is read
    assert (tmp_path / "work" / "adaptive" / "N2_G2_B64.json").exists()
    assert [record["gpus_per_node"] for record in manifest["added"]] == [2]


def test_the_last_planned_profile_gives_the_measuring_allocation_back(gpu_job, launched, tmp_path, monkeypatch):
    """Two planned profiles: the first written gives nothing back, the second (every one now written under the
    current settings) gives the allocation back at once; a profile written under other settings does not count."""
    released = []
    monkeypatch.setattr(profiling, "release_allocation", lambda work_dir: released.append(work_dir) or True)
    candidates = [{"nodes": n, "gpus_per_node": 4, "batch": 64} for n in (1, 2)]
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"candidates": candidates, "profile": candidates, "max_batch_per_device": 64}))
    job = gpu_job.updated(search={"mode": "partial", "confirm": 0})
    (tmp_path / "N2_B64.json").write_text(json.dumps({"fingerprint": "made under other settings"}))
    profiling.profile(job, plan, 1, 64, tmp_path / "N1_B64.json", tmp_path / "work")
    assert released == []
    profiling.profile(job, plan, 2, 64, tmp_path / "N2_B64.json", tmp_path / "work")
    assert released == [tmp_path / "work"]


def test_partial_search_confirms_its_choice_by_measuring_the_best_and_its_rivals(gpu_job, tmp_path, monkeypatch):
    """The model takes 2 nodes at B=64 for the fastest; measured, it is slower than predicted, so the rival at B=128
    (within the band) is measured next and chosen; then no unmeasured rival can win and the search stops."""
    truth = {(1, 64): 10.0, (2, 64): 12.0, (2, 128): 9.0}
    believed = {(1, 64): 10.0, (2, 64): 8.0, (2, 128): 9.5}
    candidates = [
        {"nodes": n, "gpus_per_node": 4, "batch": b, "per_device_batch": b // (4 * n)} for n, b in sorted(truth)
    ]
    launched = []

    def run(fn, kwargs, spec, folder, name):
        launched.append((spec.nodes, kwargs["global_batch"]))
        step = truth[(spec.nodes, kwargs["global_batch"])]
        return {"global_batch": kwargs["global_batch"], "median": {"step_s": step}}, None

    def fit_and_predict(job, profiles, grid, train_samples, memory, settings):
        measured = {(p["nodes"], p["global_batch"]): p["median"]["step_s"] for p in profiles}
        rows = []
        for c in grid:
            key = (c["nodes"], c["batch"])
            step = measured.get(key, believed[key])
            rows.append(
                {**c, "step_s": step, "time_s": step, "cost": step * c["nodes"], "profiled": key in measured}
                | {"rel_uncertainty": 0.01 if key in measured else 0.2}
            )
        return None, [], 0.0, rows

    monkeypatch.setattr(profiling.launch, "run_or_out_of_memory", run)
    monkeypatch.setattr(prediction, "fit_and_predict", fit_and_predict)  # the stage imports it where it fits
    plan = _plan(tmp_path / "plan.json", candidates)
    plan.write_text(json.dumps({**json.loads(plan.read_text()), "dataset": {"train": 1000}}))
    planned = tmp_path / "N1_B64.json"
    planned.write_text(json.dumps({"nodes": 1, "gpus_per_node": 4, "global_batch": 64, "median": {"step_s": 10.0}}))
    (tmp_path / "memory.json").write_text("{}")
    job = gpu_job.updated(search={"mode": "partial", "confirm": 3}, objective={"minimize": "time"})
    manifest = profiling.adapt(job, plan, tmp_path / "memory.json", [planned], tmp_path / "a.json", tmp_path / "w")
    assert launched == [(2, 64), (2, 128)]
    confirm = manifest["confirm"]
    assert [(p["nodes"], p["batch"], p["role"]) for p in confirm["profiles"]] == [(2, 64, "best"), (2, 128, "best")]
    assert confirm["chosen"] == {"nodes": 2, "gpus_per_node": 4, "batch": 128}
    assert confirm["stopped"] == "no unmeasured rival can still win within its band"
    assert len(manifest["added"]) == 2 and json.loads((tmp_path / "a.json").read_text())["confirm"] == confirm
    with pytest.raises(StageError, match="needs memory.json"):
        profiling.adapt(job, plan, None, [planned], tmp_path / "a.json", tmp_path / "w")

"""Stage profile: submits the timed steps (step_timing) at a planned configuration and writes what they measured."""

import json

import pytest
import yaml

from tests.conftest import job_config
from tests.unit.profile_runs import gpu_job, record_launches, write_plan
from tula_hpc.core.errors import StageError
from tula_hpc.profiling import profile_jobs
from tula_hpc.stages import profile as profiling


def test_a_profile_at_other_gpus_per_node_launches_that_many_ranks_and_records_them(tmp_path, monkeypatch):
    launched, gpu = record_launches(monkeypatch), gpu_job()
    plan = write_plan(tmp_path / "plan.json", [{"nodes": 2, "gpus_per_node": 2, "batch": 64}])
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
        profiling.profile(gpu, plan, 2, 64, tmp_path / "N2_B64.json", tmp_path / "work")


def test_the_last_planned_profile_gives_the_measuring_allocation_back(tmp_path, monkeypatch):
    """Two planned profiles: the first written gives nothing back, the second (every one now written under the
    current settings) gives the allocation back at once; a profile written under other settings does not count."""
    released = []
    record_launches(monkeypatch)
    monkeypatch.setattr(profile_jobs, "release_allocation", lambda work_dir: released.append(work_dir) or True)
    candidates = [{"nodes": n, "gpus_per_node": 4, "batch": 64} for n in (1, 2)]
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"candidates": candidates, "profile": candidates, "max_batch_per_device": 64}))
    job = gpu_job().updated(search={"mode": "partial", "confirm": 0})
    (tmp_path / "N2_B64.json").write_text(json.dumps({"fingerprint": "made under other settings"}))
    profiling.profile(job, plan, 1, 64, tmp_path / "N1_B64.json", tmp_path / "work")
    assert released == []
    profiling.profile(job, plan, 2, 64, tmp_path / "N2_B64.json", tmp_path / "work")
    assert released == [tmp_path / "work"]

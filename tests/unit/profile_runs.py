"""Profile jobs as the profile and adapt stages' tests launch them: a job on Slurm nodes of 4 GPUs, a plan, and
launches recorded instead of run."""

import json

from tests.conftest import default_job
from tula_hpc.cluster import launch


def gpu_job():
    """The default job on Slurm nodes of 4 GPUs, each candidate choosing how many of them to use."""
    return default_job().updated(launcher="slurm", resources={"gpus_per_node": 4})


def record_launches(monkeypatch) -> list:
    """Profile jobs as launched (spec, folder, name), each returning a record of the ranks it ran."""
    runs = []

    def run(fn, kwargs, spec, folder, name):
        runs.append((spec, folder, name))
        return {"world_size": spec.world_size, "global_batch": kwargs["global_batch"]}, None

    monkeypatch.setattr(launch, "run_or_out_of_memory", run)
    return runs


def write_plan(path, candidates):
    path.write_text(json.dumps({"candidates": candidates, "profile": candidates[:1], "max_batch_per_device": 64}))
    return path

"""memory_worker.py: the probe stage's worker runs its probes two at a time on the CPU's cores, one at a time on a
GPU (each probe may use the whole budget)."""

import time

import pytest

from tests.conftest import default_job
from tula_hpc.profiling import memory_worker
from tula_hpc.profiling.memory_worker import run_probes


@pytest.mark.parametrize(("gpus_per_node", "at_once"), [(0, 2), (1, 1)])
def test_probes_share_the_cpu_two_at_a_time_but_a_gpu_holds_one(monkeypatch, gpus_per_node, at_once):
    """Each probe may use the whole budget: two on one GPU would each see half of it."""
    running, most = [], []

    def probe_slowly(kind, job, batch):
        running.append(batch)
        most.append(len(running))
        time.sleep(0.2)
        running.remove(batch)
        return {"batch": batch, "outcome": "out_of_memory", "failed_at_bytes": None}

    monkeypatch.setattr(memory_worker, "run_in_fresh_process", probe_slowly)
    monkeypatch.setattr(memory_worker, "run_in_this_process", probe_slowly)  # a GPU job's, by default
    monkeypatch.setattr(memory_worker.os, "sched_getaffinity", lambda pid: {0, 1})
    # GPUs set after validation, which refuses them on the local launcher of a machine without GPUs
    job = default_job().updated(resources={"gpus_per_node": gpus_per_node})
    run_probes(job, cap=1000, budget=10**9)
    assert max(most) == at_once

"""Stage probe_memory: launches its worker by name on one device and writes memory.json from what it measured."""

import json
import pickle

from tests.conftest import default_job
from tests.unit.test_memory_model import probes_at, step_parts
from tula_hpc.profiling import memory_worker
from tula_hpc.profiling.memory_summary import summarise
from tula_hpc.stages import probe_memory


def test_the_stage_launches_its_worker_by_name_and_writes_the_summary_of_what_it_measured(tmp_path, monkeypatch):
    job = default_job()
    steps = {
        "probes": probes_at([64, 128, 256], step_parts(2e6, 5e4)),
        "trials": [],
        "collective_buffer_bytes": 0,
        "device_memory_bytes": 10**9,
        "dataset": {"train": 1000, "val": 100, "test": 100},
    }
    launched = []

    def run(fn, kwargs, spec, folder, name):
        launched.append((fn, kwargs, spec, folder, name))
        return steps

    monkeypatch.setattr(probe_memory.launch, "run", run)
    result = probe_memory.probe_memory(job, tmp_path / "memory.json", tmp_path / "work")
    [(fn, kwargs, spec, folder, name)] = launched
    assert fn == probe_memory.launch.Worker("tula_hpc.profiling.memory_worker", "probe_worker")
    assert fn.load() is memory_worker.probe_worker and kwargs == {"job": job}
    assert (spec.nodes, spec.world_size) == (1, 1) and folder == tmp_path / "work" / "probe_memory"
    assert name == "digits-cnn-probe-memory"
    assert result == summarise(job, steps) == json.loads((tmp_path / "memory.json").read_text())


def test_a_job_pickled_when_the_worker_lived_in_the_stage_finds_it():
    """Before, the stage passed its worker by reference: the pickle names tula_hpc.stages.probe_memory.probe_worker."""
    assert pickle.loads(b"ctula_hpc.stages.probe_memory\nprobe_worker\n.") is memory_worker.probe_worker

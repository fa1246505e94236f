"""tula-hpc: Tula's choice of nodes and batch for a training job, as a Snakemake workflow (README.md, "Layout", maps
the folders: core, cluster, memory, training, profiling, performance, reporting, stages, each importing only those
before it).

Modules moved into those folders; a job submitted before the move (submitit pickles its function by module path)
still finds its function under the old path: each old name below imports as the module it became. Three old
modules share their name with a folder now and cannot be found so (cluster.py, now cluster/partition.py;
performance.py, now performance/estimator.py; profiling.py, now stages/profile.py); no job pickles anything of
theirs (the profile stage's jobs run profiling/step_timing.py's worker, named by its module path).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

__version__ = "0.1.0"

MOVED = {
    "job": "core.job",
    "frozen": "core.plain_data",
    "files": "core.atomic_files",
    "layout": "core.run_layout",
    "records": "core.records",
    "devices": "cluster.devices",
    "distributed": "cluster.distributed",
    "launch": "cluster.launch",
    "launch_spec": "cluster.launch_spec",
    "allocation": "cluster.allocation",
    "slurm_states": "cluster.slurm_states",
    "budget": "memory.device_budget",
    "memory_model": "memory.model",
    "models": "training.models",
    "data": "training.data",
    "datacheck": "training.data_check",
    "training_step": "training.step",
    "strategies": "training.strategies",
    "ags": "training.ags",
    "noise_scale": "training.noise_scale",
    "progress": "training.progress",
    "checkpoint": "training.checkpoint",
    "preemption": "training.preemption",
    "loop_accounting": "training.loop_accounting",
    "memory_probes": "profiling.memory_probes",
    "step_timing": "profiling.step_timing",
    "collective_cost": "performance.collective_cost",
    "prediction": "performance.prediction",
    "run_overhead": "performance.run_overhead",
    "search": "performance.search_modes",
    "choice": "performance.choice",
    "pricing": "performance.pricing",
    "batch_schedule": "performance.batch_schedule",
    "figures": "reporting.figures",
    "training_report": "reporting.training_section",
    "search_report": "reporting.search_section",
    "stage": "stages.runner",
    "probe_memory": "stages.probe_memory",
    "plan": "stages.plan",
    "fit_model": "stages.fit_model",
    "selection": "stages.select",
    "train": "stages.train",
    "evaluate": "stages.evaluate",
    "report": "stages.report",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """`tula_hpc.<old>` imports as `tula_hpc.<MOVED[old]>`: the same module object, under both names."""

    def find_spec(self, name, path=None, target=None):
        old = name.removeprefix(f"{__name__}.")
        if old != name and old in MOVED:
            return importlib.util.spec_from_loader(name, self)
        return None

    def create_module(self, spec):
        return importlib.import_module(f"{__name__}.{MOVED[spec.name.removeprefix(__name__ + '.')]}")

    def exec_module(self, module):
        """The module ran when it was imported under its own name."""


sys.meta_path.append(_MovedModules())

"""Old import paths that work started before a move may still name, and where each lives now: the one home for them.

A Slurm job's pickle (submitit stores its function and arguments by module and name), a `work/*/job.json` record
and a checkpoint name objects by the path they had when written. Two tables say where those paths lead now:
- `MOVED_MODULES`: `tula_hpc.<old>` imports as `tula_hpc.<new>`, the same module object under both names (a finder
  on `sys.meta_path`, installed by the package's `__init__`). Three old modules share their name with a folder now
  and cannot be found so (cluster.py, now cluster/partition.py; performance.py, now performance/estimator.py;
  profiling.py, now stages/profile.py); no job pickles anything of theirs.
- `MOVED_NAMES`: a name that left a module which still exists; that module's `__getattr__ = moved_names(__name__)`
  finds it where it lives now, imported only when asked for.

When it goes: an entry serves only jobs, records and checkpoints written before its move. Release 0.2.0 drops
them all (and this module): tests/unit/test_legacy_paths.py fails once `__version__` reaches 0.2 while it exists,
so the release that says "unfinished runs of 0.1 do not resume" is the one that removes it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
from collections.abc import Callable
from typing import Any

PACKAGE = "tula_hpc"
REMOVED_IN = (0, 2)

MOVED_MODULES = {  # issue 43: the flat modules went into folders
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
    "data": "training.datasets",  # issue 55 split training.data in two: load_splits and the data sets live here
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
    "training.data": "training.datasets",  # issue 55: the data sets (the loaders went to training.loaders)
}

# module that still exists -> {name that left it: module where it lives now}
MOVED_NAMES: dict[str, dict[str, str]] = {
    "tula_hpc.stages.train": {"train_worker": "tula_hpc.training.trainer"},  # jobs pickled when the stage imported it
    "tula_hpc.stages.evaluate": {"evaluate_worker": "tula_hpc.training.evaluation"},  # the worker lived there
    "tula_hpc.stages.probe_memory": {"probe_worker": "tula_hpc.profiling.memory_worker"},  # passed by reference
    # issue 55, the launchers apart: submitit pickles the task (the Worker inside it stayed in launch.py); job.json
    # names its launcher by `Launcher.name`, not by module, and nothing pickles a launcher or a StepJob
    "tula_hpc.cluster.launch": {"DistributedTask": "tula_hpc.cluster.launchers.interface"},
}


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """`tula_hpc.<old>` imports as `tula_hpc.<MOVED_MODULES[old]>`: the same module object, under both names."""

    def find_spec(self, name, path=None, target=None):
        old = name.removeprefix(f"{PACKAGE}.")
        if old != name and old in MOVED_MODULES:
            return importlib.util.spec_from_loader(name, self)
        return None

    def create_module(self, spec):
        return importlib.import_module(f"{PACKAGE}.{MOVED_MODULES[spec.name.removeprefix(PACKAGE + '.')]}")

    def exec_module(self, module):
        """The module ran when it was imported under its own name."""


def moved_names(module: str) -> Callable[[str], Any]:
    """`module`'s `__getattr__`: a name in `MOVED_NAMES[module]` is imported from where it lives now."""
    # Run as `python -m`, the module is __main__: no pickle names a name there.
    moved = {} if module == "__main__" else MOVED_NAMES[module]

    def find(name: str) -> Any:
        if name in moved:
            return getattr(importlib.import_module(moved[name]), name)
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return find

"""tula-hpc: Tula's choice of nodes and batch for a training job, as a Snakemake workflow.

The package's map (each folder imports only those before it; tests/unit/test_imports.py holds the arrows):
- core: the job's settings, records, run layout, atomic files, errors;
- cluster: launching a stage's work on N nodes (local, Slurm, a shared allocation), devices, Slurm states;
- memory: the memory model, the device budget, the step's parts;
- training: models, data sets and loaders, optimisers and precision, strategies (AGS, AdaScale, LARS), the loop;
- profiling: memory probes and step timing on the devices;
- performance: the parallel performance model, its fitting, the search modes and the choice;
- reporting: the report's sections and figures;
- stages: one thin module per `tula-hpc <stage>`, importing the folders above and never each other.
Old import paths that unfinished work may still name lead to their new homes through `_legacy_paths`.
"""

from __future__ import annotations

import sys

from tula_hpc._legacy_paths import MovedModules

__version__ = "0.1.0"

sys.meta_path.append(MovedModules())

"""tula-hpc: Tula's memory model, performance model, configuration selection and AGS as a Slurm workflow."""

__version__ = "0.1.0"

"""What a stage's job asks for: nodes, devices, memory, time, the Slurm options, and, for a measurement in the
shared measuring phase, its allocation. Built from a job's `resources`; read by the launchers (launchers/) and by
the allocation's holder (allocation.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tula_hpc.core.job import Job, SlurmSettings


@dataclass(frozen=True)
class Allocation:
    """The measuring phase's shared allocation (resources.allocation: shared): a holder job of `nodes` nodes of the
    job's node shape for `time_min` (resources.time_min), recorded in `folder`/allocation.json, whose job steps
    the probes and profiles run as."""

    folder: str
    nodes: int
    gpus_per_node: int
    time_min: int

    @classmethod
    def for_job(cls, job: Job, folder: Path) -> Allocation:
        """As many nodes as the plan may profile (search.nodes.max; `hold_allocation` asks for no more than the
        partition allows)."""
        resources = job.resources
        return cls(str(folder), job.search.nodes.max, resources.gpus_per_node, resources.time_min)


@dataclass(frozen=True)
class LaunchSpec:
    """Where and how big: built from a job's `resources` and the launcher chosen by the profile.

    `stop_warning_s`: the warning before the time limit a training job needs to finish its step and save, sized by
    the train stage from the checkpoint saves it measured (training/attempts.py); None before any was measured."""

    launcher: str
    nodes: int = 1
    gpus_per_node: int = 0
    cpus_per_task: int = 1
    mem_gb: float = 4
    time_min: int = 60
    slurm: SlurmSettings = field(default_factory=SlurmSettings)
    max_requeues: int = 3
    allocation: Allocation | None = None
    cuda_alloc_conf: str | None = None
    stop_warning_s: int | None = None

    @classmethod
    def for_job(
        cls,
        job: Job,
        nodes: int = 1,
        one_device: bool = False,
        gpus_per_node: int | None = None,
        measuring_in: Path | None = None,
    ) -> LaunchSpec:
        """The job's resources on `nodes` nodes of `gpus_per_node` GPUs each (a candidate's own; None: the node's,
        resources.gpus_per_node); `one_device`: at most one GPU each (probing, evaluation). A measurement (probe,
        profile) passes its job's work folder as `measuring_in`: with resources.allocation shared on Slurm it runs
        as a step of the measuring phase's one allocation, and either way for resources.measure_time_min."""
        res = job.resources
        gpus = res.gpus_per_node if gpus_per_node is None else gpus_per_node
        shared = measuring_in is not None and job.launcher == "slurm" and res.allocation == "shared"
        return cls(
            launcher=job.launcher,
            nodes=nodes,
            gpus_per_node=min(gpus, 1) if one_device else gpus,
            cpus_per_task=res.cpus_per_task,
            mem_gb=res.mem_gb,
            time_min=res.time_min if measuring_in is None else res.measure_time_min,
            slurm=res.slurm,
            max_requeues=res.max_requeues,
            allocation=Allocation.for_job(job, Path(measuring_in) / "allocation") if shared else None,
            cuda_alloc_conf=res.cuda_alloc_conf if gpus > 0 else None,
        )

    @property
    def environment(self) -> dict[str, str]:
        """What every process of the job exports before torch sets up CUDA and its process group: the site's
        (resources.slurm.environment: the network NCCL and gloo use) and resources.cuda_alloc_conf."""
        allocator = {} if self.cuda_alloc_conf is None else {"PYTORCH_CUDA_ALLOC_CONF": self.cuda_alloc_conf}
        return {**(self.slurm.environment or {}), **allocator}

    @property
    def warning_before_limit_s(self) -> int | None:
        """Seconds before the time limit the job is signalled to save and stop (Slurm's --signal): `stop_warning_s`
        where measured, else a quarter of short limits, 90 s at most; None where the launcher has no time limit."""
        if self.launcher != "slurm":
            return None
        return self.stop_warning_s if self.stop_warning_s is not None else min(90, self.time_min * 60 // 4)

    @property
    def tasks_per_node(self) -> int:
        return max(1, self.gpus_per_node)

    @property
    def world_size(self) -> int:
        return self.nodes * self.tasks_per_node

"""What each stage's output depends on: the settings whose edit reruns that stage and what follows (the rules'
params), and the fingerprint that tells a reusable profile or checkpoint from one made under other settings."""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tula_hpc.core.job import Job

# What a training step is made of, apart from how many there are and the learning-rate schedule.
STEP_SETTINGS = (
    "model",
    "data",
    "train.seed",
    "train.optimizer",
    "train.momentum",
    "train.strategy",
    "train.ags",
    "train.lars",
    "train.polo",
    "train.precision",
    "train.channels_last",
    "resources.gpus_per_node",
    "resources.cpus_per_task",
    "resources.cuda_alloc_conf",
)
MEASUREMENT_SETTINGS = tuple(
    f"search.{key}" for key in ("warmup_steps", "steps", "min_measure_s", "max_attempts", "interference_tolerance")
)
FIT_SETTINGS = tuple(
    f"search.{key}"
    for key in (
        "collective",
        "sync_fit",
        "sync_prior",
        "noise_prior",
        "discrepancy_per_octave",
        "interference_tolerance",
    )
)
# What each stage's output depends on, as "section" or "section.key[.key]": the rules' params (editing one
# reruns that stage and what follows, editing anything else does not) and every fingerprint (a profile or
# checkpoint made under other settings is not reused). Which launcher runs a stage is no dependency.
STAGE_SETTINGS = {
    "probe_memory": STEP_SETTINGS
    + (
        "resources.device_memory_gb",
        "resources.mem_gb",  # the CPU's budget under device_memory_gb: auto
        "resources.memory_headroom",
        "resources.memory_probe_batches",
        "resources.memory_probes_in",
        "search.nodes",
    ),
    "plan": (
        "resources.slurm",  # the partition, whose limits bound the grid
        "search.mode",
        "search.partial_second_batch",
        "search.nodes",
        "search.gpus_per_node",
        "search.batch",
        "resources.gpus_per_node",
    ),
    "profile": STEP_SETTINGS + MEASUREMENT_SETTINGS,
    # The profiles that confirm the choice follow the objective and what predicts it (fit_model's and select's).
    "adapt": STEP_SETTINGS
    + MEASUREMENT_SETTINGS
    + FIT_SETTINGS
    + ("search.adaptive", "search.confirm", "train.epochs", "train.lr_base_batch", "objective", "resources.slurm"),
    "fit_model": FIT_SETTINGS + ("train.epochs", "objective", "resources.gpus_per_node", "resources.slurm"),
    "select": ("objective",),
    "train": ("model", "data", "train", "resources.on_oom", "resources.cuda_alloc_conf"),
    "evaluate": ("model", "data", "train.seed", "objective", "resources.gpus_per_node"),
    "report": (),
}


def stage_settings(settings: dict, stage: str) -> dict[str, Any]:
    """The settings `stage` depends on (STAGE_SETTINGS), keyed by their dotted names, from a job's settings as plain
    data (a rule's config, or Job.as_dict())."""
    picked = {}
    for name in STAGE_SETTINGS[stage]:
        value: Any = settings
        for key in name.split("."):
            value = value.get(key) if isinstance(value, dict) else None
        picked[name] = value
    return picked


def fingerprint(job: Job, stage: str) -> str:
    """A short hash of what `stage` depends on: equal fingerprints mean reusable results."""
    settings = stage_settings(job.as_dict(), stage)
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]

"""What each stage's output depends on: the settings whose edit reruns that stage and what follows (the rules'
params), and the fingerprint that tells a reusable profile or checkpoint from one made under other settings."""

from __future__ import annotations

import copy
import hashlib
import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tula_hpc.core.job import Job

# What a training step is made of, apart from how many there are and the learning-rate schedule.
STEP_SETTINGS = (
    "task",
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
# How long the run is, beside train.epochs: what the predicted time of a candidate follows.
RUN_LENGTH_SETTINGS = ("train.tokens", "train.steps")
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
    + ("search.adaptive", "search.confirm", "train.epochs", "train.lr_base_batch", "objective", "resources.slurm")
    + RUN_LENGTH_SETTINGS,
    "fit_model": FIT_SETTINGS
    + ("train.epochs", "objective", "resources.gpus_per_node", "resources.slurm")
    + RUN_LENGTH_SETTINGS,
    "select": ("objective",) + RUN_LENGTH_SETTINGS,
    "train": ("task", "model", "data", "train", "resources.on_oom", "resources.cuda_alloc_conf"),
    "evaluate": ("task", "model", "data", "train.seed", "objective", "resources.gpus_per_node"),
    "report": (),
}


# Settings that came after results existed, at the value every earlier job ran with: a job that leaves them there
# keeps its rule params and fingerprints, so its results and checkpoints in flight stay reusable (a test checks
# each value against the schema's default).
LATER_SETTINGS = {
    "task": {"name": "image_classification", "kwargs": {}},
    "data.seq_len": None,
    "train.betas": [0.9, 0.95],
    "train.eps": 1e-8,
    "train.grad_clip": None,
    "train.lr_schedule": {"kind": "multistep", "warmup_steps": 0, "min_lr_ratio": 0.1},
    "train.tokens": None,
    "train.steps": None,
    "train.val_every_steps": None,
    "train.val_samples": None,
    "train.ags.exclude": None,
    "train.val_every_tokens": None,
    "train.batch_schedule_every": None,
    "train.ramp": {"start_batch": None, "fraction": 0.2},
    "train.adam_moments_on_batch_change": "keep",
}


def _without_later_defaults(settings: dict) -> dict:
    """The settings less those of LATER_SETTINGS left at their earlier value."""
    settings = copy.deepcopy(settings)
    for name, earlier in LATER_SETTINGS.items():
        section, key = _section_of(settings, name)
        if section is not None and key in section and _plain(section[key]) == earlier:
            del section[key]
    return settings


def _section_of(settings: dict, name: str) -> tuple[dict | None, str]:
    """The mapping that holds the dotted setting `name` (None where a section on the way is missing), and its key."""
    *parents, key = name.split(".")
    section: Any = settings
    for parent in parents:
        section = section.get(parent) if isinstance(section, dict) else None
    return (section if isinstance(section, dict) else None), key


def _plain(value: Any) -> Any:
    """A setting as JSON holds it (a tuple as a list)."""
    return json.loads(json.dumps(value))


def stage_settings(settings: dict, stage: str) -> dict[str, Any]:
    """The settings `stage` depends on (STAGE_SETTINGS), keyed by their dotted names, from a job's settings as plain
    data (a rule's config, or Job.as_dict()); a later setting at its earlier value is left out (LATER_SETTINGS)."""
    settings = _without_later_defaults(settings)
    picked = {}
    for name in STAGE_SETTINGS[stage]:
        if name in LATER_SETTINGS and _missing(settings, name):
            continue
        value: Any = settings
        for key in name.split("."):
            value = value.get(key) if isinstance(value, dict) else None
        picked[name] = value
    return picked


def _missing(settings: dict, name: str) -> bool:
    section, key = _section_of(settings, name)
    return section is None or key not in section


def fingerprint(job: Job, stage: str) -> str:
    """A short hash of what `stage` depends on: equal fingerprints mean reusable results."""
    settings = stage_settings(job.as_dict(), stage)
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]

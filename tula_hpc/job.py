"""A typed, frozen view of one validated job: `job.train.epochs` rather than `job["train"]["epochs"]`.

Built once, after the schema (workflow/schemas/jobs.schema.yaml) has filled in its defaults and config.py the
device's, as torchtitan builds its trainer's config: the schema stays the one source of defaults, types and
descriptions, and tests/unit/test_job.py fails if one of its fields has no home here or the reverse. A free-form
mapping of the schema (a model's or data set's kwargs, charge factors) stays a dict; a list becomes a tuple.
"""

from __future__ import annotations

import copy
import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any


class _Section:
    """A job's section, read by key as the dict it replaces was."""

    def __getitem__(self, key: str) -> Any:
        if key not in {f.name for f in dataclasses.fields(self)}:
            raise KeyError(key)
        return getattr(self, key)

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key, default)

    def keys(self) -> list[str]:
        return [f.name for f in dataclasses.fields(self) if not _left_out(self, f)]


def _left_out(section: Any, spec: dataclasses.Field) -> bool:
    """A key the user may leave out, and left out (resources.slurm's): absent from as_dict(), as from the dict."""
    return spec.metadata.get("optional", False) and getattr(section, spec.name) is None


def _optional(default: Any = None) -> Any:
    return field(default=default, metadata={"optional": True})


@dataclass(frozen=True)
class ModelSettings(_Section):
    name: str
    kwargs: dict


@dataclass(frozen=True)
class DataSettings(_Section):
    name: str
    root: str | None
    augment: str
    kwargs: dict
    image_size: int
    val_fraction: float
    test_fraction: float
    num_workers: int | str


@dataclass(frozen=True)
class AgsSettings(_Section):
    delta: float
    small_batch: int
    granularity: str
    update_every_steps: int | None
    s_min: float | None
    static_scale: float
    base: str


@dataclass(frozen=True)
class LarsSettings(_Section):
    trust_coefficient: float


@dataclass(frozen=True)
class PoloSettings(_Section):
    sync_epochs: int
    averages_per_epoch: int


@dataclass(frozen=True)
class TrainSettings(_Section):
    epochs: int
    optimizer: str
    lr: float
    momentum: float
    weight_decay: float
    lr_milestones: tuple[int, ...]
    lr_gamma: float
    seed: int
    strategy: str
    warmup_epochs: int
    lr_base_batch: int
    precision: str
    channels_last: bool
    ags: AgsSettings
    lars: LarsSettings
    polo: PoloSettings


@dataclass(frozen=True)
class Span(_Section):
    """A searched range, both ends included: max "auto" for search.batch is the memory stage's largest batch."""

    min: int
    max: int | str


@dataclass(frozen=True)
class SyncTerms(_Section):
    latency_s: float
    bandwidth_gb_s: float


@dataclass(frozen=True)
class SyncPrior(_Section):
    intra_node: SyncTerms
    inter_node: SyncTerms


@dataclass(frozen=True)
class AdaptiveSettings(_Section):
    tolerance: float
    max_profiles: int | None


@dataclass(frozen=True)
class SearchSettings(_Section):
    mode: str
    partial_second_batch: str
    nodes: Span
    gpus_per_node: Span
    batch: Span
    warmup_steps: int
    steps: int
    min_measure_s: float
    max_attempts: int
    interference_tolerance: float
    collective: str
    sync_fit: str
    sync_prior: SyncPrior
    noise_prior: float
    discrepancy_per_octave: float
    adaptive: AdaptiveSettings


@dataclass(frozen=True)
class SlurmSettings(_Section):
    """What sbatch is told beside the resources; a key the user left out is not passed."""

    partition: str | None = _optional()
    account: str | None = _optional()
    qos: str | None = _optional()
    constraint: str | None = _optional()
    extra_args: tuple[str, ...] | None = _optional()


@dataclass(frozen=True)
class ResourceSettings(_Section):
    gpus_per_node: int
    cpus_per_task: int
    mem_gb: float
    time_min: int
    measure_time_min: int
    allocation: str
    time_limit: str
    time_margin: float
    device_memory_gb: float | str
    max_requeues: int
    checkpoint_every_steps: int | None
    memory_headroom: float
    memory_probe_batches: tuple[int, ...]
    on_oom: str
    slurm: SlurmSettings


@dataclass(frozen=True)
class ObjectiveSettings(_Section):
    minimize: str
    queue: str
    knee_method: str
    knee_min_saving: float
    pricing: str
    price_per_node_hour: float
    price_per_gb_hour: float
    charge_factors: dict
    max_nodes: int | None
    max_batch: int | None
    deadline_s: float | None
    budget: float | None


@dataclass(frozen=True)
class Job(_Section):
    """One job as every stage sees it: its sections, its name, and the launcher that runs its stages."""

    name: str
    launcher: str
    model: ModelSettings
    data: DataSettings
    train: TrainSettings
    search: SearchSettings
    resources: ResourceSettings
    objective: ObjectiveSettings

    @classmethod
    def from_dict(cls, settings: dict) -> Job:
        """The view of a validated job's settings (config.job_settings's, or as_dict()'s)."""
        return _build(cls, settings)

    def as_dict(self) -> dict:
        """The settings as plain data: what is fingerprinted, written to JSON and handed to another process."""
        return _plain(self)

    def updated(self, **sections: dict) -> Job:
        """This job with some settings changed key by key, e.g. updated(train={"epochs": 3})."""
        return Job.from_dict(_merged(self.as_dict(), sections))


def _build(kind: type, settings: dict) -> Any:
    hints = typing.get_type_hints(kind)
    values = {}
    for spec in dataclasses.fields(kind):
        if spec.name not in settings:
            continue  # an optional key left out: its default
        value, hint = settings[spec.name], hints[spec.name]
        if dataclasses.is_dataclass(hint):
            value = _build(hint, value)
        elif isinstance(value, list):
            value = tuple(value)
        elif isinstance(value, dict):
            value = copy.deepcopy(value)
        values[spec.name] = value
    unknown = set(settings) - set(values) - {f.name for f in dataclasses.fields(kind)}
    if unknown:
        raise TypeError(f"{kind.__name__} has no field(s) {', '.join(sorted(unknown))}")
    return kind(**values)


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value) if not _left_out(value, f)}
    if isinstance(value, tuple):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    return value


def _merged(base: dict, changes: dict) -> dict:
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merged(base[key], value)
        else:
            base[key] = copy.deepcopy(value)
    return base

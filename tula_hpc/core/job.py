"""A typed, frozen view of one validated job: `job.train.epochs` rather than `job["train"]["epochs"]`.

Built once, after the schema (workflow/schemas/jobs.schema.yaml) has filled in its defaults and config.py the
device's, as torchtitan builds its trainer's config: the schema stays the one source of defaults, types and
descriptions, and tests/unit/test_job.py fails if one of its fields has no home here or the reverse. A free-form
mapping of the schema (a model's or data set's kwargs, charge factors) stays a dict; a list becomes a tuple.
"""

from __future__ import annotations

from dataclasses import dataclass

from tula_hpc.core.plain_data import deep_update, from_plain, optional, to_plain


@dataclass(frozen=True)
class ModelSettings:
    name: str
    kwargs: dict


@dataclass(frozen=True)
class TaskSettings:
    name: str
    kwargs: dict


@dataclass(frozen=True)
class DataSettings:
    name: str
    root: str | None
    augment: str
    kwargs: dict
    image_size: int
    val_fraction: float
    test_fraction: float
    num_workers: int | str
    seq_len: int | None


@dataclass(frozen=True)
class AgsSettings:
    delta: float
    small_batch: int
    granularity: str
    update_every_steps: int | None
    s_min: float | None
    static_scale: float
    base: str
    exclude: tuple[str, ...] | None = None


@dataclass(frozen=True)
class LarsSettings:
    trust_coefficient: float


@dataclass(frozen=True)
class PoloSettings:
    sync_epochs: int
    averages_per_epoch: int


@dataclass(frozen=True)
class LrScheduleSettings:
    kind: str
    warmup_steps: int
    min_lr_ratio: float


@dataclass(frozen=True)
class RampSettings:
    start_batch: int | None = None
    fraction: float = 0.2


@dataclass(frozen=True)
class TrainSettings:
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
    betas: tuple[float, float]
    eps: float
    grad_clip: float | None
    lr_schedule: LrScheduleSettings
    batch_schedule: str = "fixed"
    tokens: int | None = None
    steps: int | None = None
    val_every_steps: int | None = None
    val_samples: int | None = None
    val_every_tokens: int | None = None
    batch_schedule_every: int | None = None
    ramp: RampSettings = RampSettings()
    adam_moments_on_batch_change: str = "keep"


@dataclass(frozen=True)
class Span:
    """A searched range, both ends included: max "auto" for search.batch is the memory stage's largest batch."""

    min: int
    max: int | str


@dataclass(frozen=True)
class SyncTerms:
    latency_s: float
    bandwidth_gb_s: float


@dataclass(frozen=True)
class SyncPrior:
    intra_node: SyncTerms
    inter_node: SyncTerms


@dataclass(frozen=True)
class AdaptiveSettings:
    tolerance: float
    max_profiles: int | None


@dataclass(frozen=True)
class SearchSettings:
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
    confirm: int


@dataclass(frozen=True)
class SlurmSettings:
    """What sbatch is told beside the resources; a key the user left out is not passed."""

    partition: str | None = optional()
    account: str | None = optional()
    qos: str | None = optional()
    constraint: str | None = optional()
    reservation: str | None = optional()
    wckey: str | None = optional()  # None: no --wckey at all (submitit would write its own)
    gpu_type: str | None = optional()
    gpu_binding: str | None = optional()  # None: "node"
    mem_per_gpu_gb: float | None = optional()
    setup: tuple[str, ...] | None = optional()
    environment: dict | None = optional()
    extra_args: tuple[str, ...] | None = optional()
    file_system_lag_s: float | None = optional()  # None: cluster.shared_files.FILE_SYSTEM_LAG_S


@dataclass(frozen=True)
class ResourceSettings:
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
    cuda_alloc_conf: str | None
    memory_probes_in: str
    on_oom: str
    slurm: SlurmSettings


@dataclass(frozen=True)
class ObjectiveSettings:
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
class Job:
    """One job as every stage sees it: its sections, its name, and the launcher that runs its stages."""

    name: str
    launcher: str
    task: TaskSettings
    model: ModelSettings
    data: DataSettings
    train: TrainSettings
    search: SearchSettings
    resources: ResourceSettings
    objective: ObjectiveSettings

    @classmethod
    def from_dict(cls, settings: dict) -> Job:
        """The view of a validated job's settings (config.job_settings's, or as_dict()'s)."""
        return from_plain(cls, settings, "")

    def as_dict(self) -> dict:
        """The settings as plain data: what is fingerprinted, written to JSON and handed to another process."""
        return to_plain(self)

    def updated(self, **sections: dict) -> Job:
        """This job with some settings changed key by key, e.g. updated(train={"epochs": 3})."""
        return Job.from_dict(deep_update(self.as_dict(), sections))


# The recipes (a baseline strategy's optimiser, peak rate and warm-up) that warm up; how each scales its rate is
# training/lr_schedule.py's RATE_RULES.
WARMUP_RECIPES = frozenset({"lrs", "lars", "polo"})


def recipe(train: TrainSettings) -> str:
    """The strategy whose optimiser, peak rate and warm-up a run follows: static and ags scale the gradients of
    train.ags.base (sgd, the paper's: plain SGD at lr without warm-up, as lbt), every other strategy its own."""
    if train.strategy in ("static", "ags"):
        return {"sgd": "lbt"}.get(train.ags.base, train.ags.base)
    return train.strategy

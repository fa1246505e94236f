"""Load and validate config/jobs.yaml: one clear message per mistake, before anything is submitted.

The JSON Schema in workflow/schemas/jobs.schema.yaml is the single source of truth for keys, types
and defaults; the Snakefile applies it with snakemake.utils.validate, stages run standalone apply it
here. What a schema cannot say (min <= max, data on disk, models that build for the data, a GPU job's needs) is
checked below, and defaults that depend on other fields (search.sync_prior, by device) are filled in below.
"""

from __future__ import annotations

import copy
from pathlib import Path

import jsonschema
import yaml

from tula_hpc.cluster.devices import cuda_setup, usable_gpus
from tula_hpc.cluster.slurm_options import SlurmOptionError, extra_options
from tula_hpc.core.job import WARMUP_RECIPES, Job, recipe
from tula_hpc.core.plain_data import deep_update, to_plain
from tula_hpc.core.run_layout import ranks_per_host
from tula_hpc.performance.sync_priors import FIT_DEFAULTS, SYNC_PRIORS, sync_device
from tula_hpc.training.data_check import IMAGE_SHAPE_KEYS, DataError, builtin_shape_keys, check_data
from tula_hpc.training.lr_schedule import refusal, strategies_under

SCHEMA_PATH = Path(__file__).resolve().parent.parent / "workflow" / "schemas" / "jobs.schema.yaml"

# Smallest input side each built-in image network accepts (its downsampling would reach zero below it): those
# without model.kwargs are checked by this table, without importing torch; any other model (gpt too) is built and run.
MIN_IMAGE_SIZE = {
    "tiny_cnn": 2,
    "bn_cnn": 4,
    "cifar_resnet": 1,
    "resnet18": 8,
    "resnet50": 8,
    "mobilenet_v3_small": 16,
    "mobilenet_v3_large": 16,
    "vgg11": 32,
    "alexnet": 63,
}

# Host memory (resources.mem_gb) each GPU rank needs of its own, GB: a floor, not an estimate. A CUDA context and
# torch's CUDA libraries alone take about 2 GB of host RSS (pytorch/pytorch#113326: 2.0 GB peak RSS for one tensor
# on a GPU, torch 2.2 with CUDA 11.8; #12873: 1.9 GB after one convolution), and 1 GB more for the data set, pinned
# batches and loader workers; a large data set or many workers need more.
HOST_GB_PER_GPU_RANK = 3
# A shared file system slower than this is broken, not lagging; and a job that left no result waits this long
MAX_FILE_SYSTEM_LAG_S = 600

# Variables the launcher sets in every rank, which resources.slurm.environment would overwrite -> why.
LAUNCHER_VARIABLES = {
    **dict.fromkeys(
        ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"),
        "torch.distributed's, set from Slurm's for each rank",
    ),
    "CUDA_VISIBLE_DEVICES": "Slurm's, for the GPUs it gave the rank",
    "PYTORCH_CUDA_ALLOC_CONF": "set by resources.cuda_alloc_conf",
}


class ConfigError(ValueError):
    """The job configuration is invalid; the message names the job, the field and what is allowed."""


def _schema() -> dict:
    return yaml.safe_load(SCHEMA_PATH.read_text())


def _validator_with_defaults() -> type:
    """A validator that fills in schema defaults, as snakemake.utils.validate(set_default=True) does."""
    base = jsonschema.Draft202012Validator

    def set_defaults(validator, properties, instance, schema):
        if isinstance(instance, dict):
            for name, sub in properties.items():
                if "default" in sub and name not in instance:
                    instance[name] = copy.deepcopy(sub["default"])
        yield from base.VALIDATORS["properties"](validator, properties, instance, schema)

    return jsonschema.validators.extend(base, {"properties": set_defaults})


def _where(path: list) -> str:
    if len(path) >= 2 and path[0] == "jobs":
        field = ".".join(str(p) for p in path[2:])
        return f"job '{path[1]}': field '{field}'" if field else f"job '{path[1]}'"
    return f"field '{'.'.join(str(p) for p in path)}'" if path else "top level"


def _explain(error: jsonschema.ValidationError) -> str:
    where = _where(list(error.absolute_path))
    schema = error.schema
    if error.validator == "additionalProperties":
        unknown = sorted(set(error.instance) - set(schema.get("properties", {})))
        if not schema.get("properties"):
            return f"{where}: {error.message}"
        allowed = ", ".join(sorted(schema["properties"]))
        return f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; allowed keys: {allowed}"
    if error.validator == "required":
        return f"{where}: {error.message}"
    if error.validator == "enum":
        allowed = ", ".join(map(str, error.validator_value))
        return f"{where}: {error.instance!r} is not allowed; allowed: {allowed}"
    if error.validator == "type":
        return f"{where}: {error.instance!r} has the wrong type; expected {error.validator_value}"
    if error.validator in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"):
        return f"{where}: {error.message} ({schema.get('description', '')})"
    description = schema.get("description") or ""
    return f"{where}: {error.instance!r} is not valid; allowed: {description or error.message}"


def _fill_by_device(job: dict) -> None:
    """search.sync_prior's figures, sync_fit and discrepancy_per_octave the user left out, from the presets of the
    job's device (cluster/devices.py), and search.gpus_per_node's ends, the node's own GPUs: a schema default cannot
    depend on resources.gpus_per_node."""
    gpus = job["resources"]["gpus_per_node"]
    job["search"]["gpus_per_node"] = {"min": gpus, "max": gpus, **job["search"].get("gpus_per_node", {})}
    prior = job["search"].setdefault("sync_prior", {})
    for kind, terms in SYNC_PRIORS[sync_device(gpus)].items():
        prior[kind] = {**terms, **prior.get(kind, {})}
    for key, value in FIT_DEFAULTS[sync_device(gpus)].items():
        job["search"].setdefault(key, value)


def _bandwidths(prior: dict) -> str:
    """A sync prior's bandwidths, for people: a preset of sync_priors.SYNC_PRIORS, or a job's as plain data."""
    return ", ".join(f"{kind} {terms['bandwidth_gb_s']:g} GB/s" for kind, terms in prior.items())


def _check_semantics(job: Job) -> None:
    def fail(field: str, message: str) -> None:
        raise ConfigError(f"job '{job.name}': field '{field}': {message}")

    nodes, batch = job.search.nodes, job.search.batch
    if nodes.min > nodes.max:
        fail("search.nodes", f"min ({nodes.min}) is larger than max ({nodes.max})")
    if batch.max != "auto" and batch.min > batch.max:
        fail("search.batch", f"min ({batch.min}) is larger than max ({batch.max})")
    objective = job.objective
    if objective.max_nodes is not None and objective.max_nodes < nodes.min:
        fail(
            "objective.max_nodes",
            f"{objective.max_nodes} is below search.nodes.min ({nodes.min}): no candidate "
            f"could meet it; allowed: at least {nodes.min}",
        )
    if objective.max_batch is not None and objective.max_batch < batch.min:
        fail(
            "objective.max_batch",
            f"{objective.max_batch} is below search.batch.min ({batch.min}): no candidate "
            f"could meet it; allowed: at least {batch.min}",
        )
    _check_data_and_model(job, fail)
    _check_run_length(job, fail)
    train, epochs = job.train, job.train.epochs
    probes = list(job.resources.memory_probe_batches)
    if probes != sorted(set(probes)):
        fail("resources.memory_probe_batches", f"{probes} must be distinct batches in increasing order")
    if train.strategy == "ags" and probes[0] < train.ags.small_batch:
        fail(
            "resources.memory_probe_batches",
            f"{probes[0]} is below train.ags.small_batch ({train.ags.small_batch}): "
            f"that probe would skip the per-epoch scaling update; allowed: at least {train.ags.small_batch}",
        )
    if train.strategy == "polo" and train.polo.sync_epochs >= epochs:
        fail(
            "train.polo.sync_epochs",
            f"{train.polo.sync_epochs} synchronous epochs of {epochs} would never "
            f"start local SGD; allowed: below {epochs}",
        )
    lag = job.resources.slurm.file_system_lag_s
    if lag is not None and not 0 <= lag <= MAX_FILE_SYSTEM_LAG_S:
        fail("resources.slurm.file_system_lag_s", f"{lag} s; allowed: 0 to {MAX_FILE_SYSTEM_LAG_S} s")
    _check_gpus_per_node(job, fail)
    _check_gpu_job(job, fail)
    _check_slurm(job, fail)
    _check_optimizer(job, fail)
    _check_batch_schedule(job, fail)


def _check_data_and_model(job: Job, fail) -> None:
    """The data set is there and well formed, and the model builds for its shape and fits the task (`fail`:
    _check_semantics')."""
    data = job.data
    try:
        check_data(data)
    except DataError as err:
        raise ConfigError(f"job '{job.name}': {err}") from None
    if data.val_fraction + data.test_fraction >= 1:
        fail("data", "val_fraction + test_fraction must be below 1")
    model = job.model
    known = builtin_shape_keys(data) == IMAGE_SHAPE_KEYS and job.task.name == "image_classification"
    if model.name not in MIN_IMAGE_SIZE or model.kwargs or not known:
        # The task checked against the data's shape and a user's samples, and the model built once for that shape
        # and run on two of the task's samples on the meta device. torch (seconds to import) only here: the built-in
        # image classifiers without kwargs are known to build on built-in images, at MIN_IMAGE_SIZE and above.
        from tula_hpc.training.datasets import check_samples, data_shape
        from tula_hpc.training.models import ModelError, check_model
        from tula_hpc.training.tasks import TaskError, job_task

        try:
            task, shape = job_task(job), data_shape(data)
            task.check_shape(shape, data.name)
            check_samples(data, task)
            check_model(model.name, shape, model.kwargs, task=task)
        except (ModelError, TaskError) as err:
            fail(err.field, str(err))
        except DataError as err:
            raise ConfigError(f"job '{job.name}': {err}") from None
    elif data.image_size < MIN_IMAGE_SIZE[model.name]:
        fail(
            "data.image_size",
            f"{model.name} needs images of at least {MIN_IMAGE_SIZE[model.name]} pixels, got {data.image_size}",
        )


def _check_run_length(job: Job, fail) -> None:
    """How long the run is: one of train.tokens and train.steps at most (either replaces train.epochs), tokens
    counted in data.seq_len windows, and the epochs' milestones and warm-up within train.epochs (`fail`:
    _check_semantics')."""
    train, epochs = job.train, job.train.epochs
    if train.tokens is not None and train.steps is not None:
        fail("train.tokens", "train.tokens and train.steps are both set; allowed: one of them, or neither")
    if train.tokens is not None and job.data.seq_len is None:
        fail("train.tokens", "counts data.seq_len tokens per sample, and data.seq_len is unset; allowed: train.steps")
    multistep = train.lr_schedule.kind == "multistep"  # the schedule that reads these
    late = [m for m in train.lr_milestones if m > epochs]
    if late and multistep:
        fail("train.lr_milestones", f"milestones {late} lie beyond the last epoch ({epochs})")
    if multistep and recipe(train) in WARMUP_RECIPES and train.warmup_epochs >= epochs:
        fail(
            "train.warmup_epochs",
            f"strategy '{train.strategy}' ({recipe(train)}'s recipe) would warm up for {train.warmup_epochs} "
            f"of {epochs} epochs and never train at its full rate; allowed: below {epochs}",
        )


def _check_optimizer(job: Job, fail) -> None:
    """The strategies lr_schedule.RATE_RULES refuses under the job's optimiser, and AGS and static scaling on lars'
    recipe under adamw (`fail`: _check_semantics'). The goodput objectives and the adaptive batch run under either:
    under adamw their noise scale is the preconditioned gradient's (training/noise_scale.py)."""
    train = job.train
    if reason := refusal(train.strategy, train.optimizer):
        allowed = ", ".join(strategies_under(train.optimizer))
        fail("train.strategy", f"'{train.strategy}' under {train.optimizer}: {reason}; allowed: {allowed}")
    if train.optimizer == "adamw" and train.strategy in ("static", "ags") and train.ags.base == "lars":
        fail(
            "train.ags.base",
            f"'lars' under {train.optimizer}: its Adam form (LAMB) folds the weight decay into the update its trust "
            f"ratio scales, and AGS's Adam form scales AdamW's update with the decay decoupled; allowed: sgd, lrs",
        )


# strategy -> why a batch that follows the noise scale (train.batch_schedule adaptive, performance/batch_schedule.py)
# makes no sense with it
ADAPTIVE_BATCH_REFUSED = {
    "polo": "its local SGD all-reduces no gradients to measure the noise scale with, and its averaging period is "
    "laid out in the first batch's steps"
}


def _check_batch_schedule(job: Job, fail) -> None:
    """train.batch_schedule adaptive and ramp need a strategy they make sense with (ADAPTIVE_BATCH_REFUSED); adaptive
    needs two ranks or more, which measure the noise scale it follows; ramp starts at most at the largest batch
    searched (the stage holds it against the selected one, the ramp's end)."""
    train = job.train
    if train.batch_schedule == "fixed":
        return
    if train.steps is not None:
        fail(
            "train.steps",
            f"a run in optimiser steps has no fixed length once train.batch_schedule {train.batch_schedule} changes "
            "its batch; allowed: train.tokens or train.epochs",
        )
    if train.strategy in ADAPTIVE_BATCH_REFUSED:
        fail(
            "train.batch_schedule",
            f"{train.batch_schedule} with strategy '{train.strategy}': {ADAPTIVE_BATCH_REFUSED[train.strategy]}; "
            f"allowed: fixed, or any strategy but {', '.join(ADAPTIVE_BATCH_REFUSED)}",
        )
    if train.batch_schedule == "ramp":
        start, largest = train.ramp.start_batch or train.lr_base_batch, job.search.batch.max
        if isinstance(largest, int) and start > largest:
            fail(
                "train.ramp.start_batch",
                f"{start} is above the largest batch searched (search.batch.max {largest}), so above any selected "
                f"batch the ramp would end at; allowed: 1 to {largest}",
            )
        return
    ranks = job.search.nodes.max * max(1, job.search.gpus_per_node.max)
    if ranks < 2:
        fail(
            "train.batch_schedule",
            f"adaptive on at most {ranks} rank (search.nodes.max x search.gpus_per_node.max): the noise scale it "
            f"follows is measured between two ranks or more; allowed: fixed, ramp, or search over 2 ranks or more",
        )


def _check_gpus_per_node(job: Job, fail) -> None:
    """search.gpus_per_node within the node: Slurm is asked for resources.gpus_per_node at most, and a CPU job has
    no GPUs to choose from (`fail`: _check_semantics' error for a field)."""
    shape, gpus = job.search.gpus_per_node, job.resources.gpus_per_node
    if not gpus and (shape.min, shape.max) != (0, 0):
        fail(
            "search.gpus_per_node",
            f"{{min: {shape.min}, max: {shape.max}}} on a CPU job (resources.gpus_per_node: 0, one process "
            f"per node); allowed: {{min: 0, max: 0}}, or leave it out",
        )
    if gpus and not 1 <= shape.min <= shape.max <= gpus:
        fail(
            "search.gpus_per_node",
            f"{{min: {shape.min}, max: {shape.max}}} does not fit the node's {gpus} GPU(s) "
            f"(resources.gpus_per_node); allowed: 1 <= min <= max <= {gpus}",
        )


def _check_slurm(job: Job, fail) -> None:
    """resources.slurm beyond its types: extra_args that split into sbatch options the project can pass, and an
    environment that leaves the launcher's own variables alone (`fail`: _check_semantics' error for a field)."""
    slurm = job.resources.slurm
    try:
        extra_options(slurm.extra_args or ())
    except SlurmOptionError as err:
        fail("resources.slurm.extra_args", err.reason)
    for name in slurm.environment or {}:
        if name in LAUNCHER_VARIABLES or name.startswith("SLURM_"):
            why = LAUNCHER_VARIABLES.get(name, "Slurm's own")
            fail("resources.slurm.environment", f"{name} is {why}; allowed: any other variable")


def _check_gpu_job(job: Job, fail) -> None:
    """What a GPU job needs that a CPU job does not: host memory per GPU rank, NCCL's sync priors, and on the local
    launcher a usable GPU of its own for every rank (`fail`: _check_semantics' error for a field)."""
    gpus, mem_gb, mem_per_gpu_gb = job.resources.gpus_per_node, job.resources.mem_gb, job.resources.slurm.mem_per_gpu_gb
    if gpus and mem_per_gpu_gb is not None and mem_per_gpu_gb < HOST_GB_PER_GPU_RANK:
        fail(
            "resources.slurm.mem_per_gpu_gb",
            f"{mem_per_gpu_gb} GB of host memory per GPU rank; each needs at least {HOST_GB_PER_GPU_RANK} GB of its "
            f"own (its CUDA context, torch's CUDA libraries, loader workers); allowed: at least {HOST_GB_PER_GPU_RANK}",
        )
    if gpus and mem_per_gpu_gb is None and mem_gb < gpus * HOST_GB_PER_GPU_RANK:
        fail(
            "resources.mem_gb",
            f"{mem_gb} GB of host memory per node is shared by its {gpus} GPU ranks (resources.gpus_per_node), "
            f"each of which needs at least {HOST_GB_PER_GPU_RANK} GB of its own (its CUDA context, torch's CUDA "
            f"libraries, loader workers); allowed: at least {gpus * HOST_GB_PER_GPU_RANK}",
        )
    prior, cpu = job.search.sync_prior, SYNC_PRIORS["cpu"]
    if gpus and all(getattr(prior, kind).bandwidth_gb_s <= terms["bandwidth_gb_s"] for kind, terms in cpu.items()):
        fail(
            "search.sync_prior",
            f"bandwidths of {_bandwidths(to_plain(prior))} are gloo's on CPUs, but this job runs on GPUs "
            f"(resources.gpus_per_node: {gpus}), whose NCCL sync they would predict about 100 times too slow; "
            f"allowed: a bandwidth above gloo's ({_bandwidths(cpu)}) for at least one kind: leave "
            f"search.sync_prior out for the GPU preset ({_bandwidths(SYNC_PRIORS['gpu'])}) or write your "
            f"cluster's own figures",
        )
    if gpus and job.launcher == "local":
        # Every node runs on this machine, so ask its CUDA now, before anything is submitted (torch, seconds to
        # import, only here). On Slurm a login node has no GPU to ask: each rank checks its own (rank_gpu).
        here, nodes = usable_gpus(), job.search.nodes.max
        if not here:
            fail(
                "resources.gpus_per_node",
                f"{gpus} GPU(s) per node on the local launcher, but CUDA is not usable on this machine "
                f"({cuda_setup()}); allowed: 0 (CPU only), or run where CUDA works (a driver as new as the "
                f"wheel's CUDA, CUDA_VISIBLE_DEVICES naming the GPUs) or on the slurm launcher",
            )
        ranks = ranks_per_host("local", nodes, gpus)
        if ranks > here:
            fail(
                "search.nodes.max",
                f"{nodes} nodes x {gpus} GPU(s) (resources.gpus_per_node) are {ranks} ranks, each needing "
                f"a GPU of its own (NCCL refuses two ranks on one), but the local launcher runs every node on "
                f"this machine, which has {here}; allowed: search.nodes.max x resources.gpus_per_node at most "
                f"{here}",
            )


def validate_config(config: dict) -> dict:
    """Validate in place (filling defaults) and return the config; raise ConfigError on the first mistake."""
    if not isinstance(config, dict):
        raise ConfigError("top level: the configuration must be a mapping with a 'jobs' key")
    validator = _validator_with_defaults()(_schema())
    errors = sorted(
        validator.iter_errors(config), key=lambda e: (len(e.absolute_path), list(map(str, e.absolute_path)))
    )
    if errors:
        raise ConfigError(_explain(jsonschema.exceptions.best_match(errors)))
    unknown = [name for name in config["targets"] or [] if name not in config["jobs"]]
    if unknown:
        raise ConfigError(
            f"field 'targets': {', '.join(map(repr, unknown))} name no job; allowed: {', '.join(config['jobs'])}"
        )
    for name, job in config["jobs"].items():
        _fill_by_device(job)
        _check_semantics(job_settings(config, name))
    return config


def load_config(paths: list[str | Path], overrides: dict | None = None) -> dict:
    """Read jobs files (later ones update earlier ones, as Snakemake merges them), apply overrides, validate."""
    config: dict = {}
    for path in map(Path, paths):
        try:
            loaded = yaml.safe_load(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: file not found") from None
        except yaml.YAMLError as err:
            raise ConfigError(f"{path}: not valid YAML ({err})") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: top level: the configuration must be a mapping with a 'jobs' key")
        deep_update(config, loaded)
    config.update({k: v for k, v in (overrides or {}).items() if v is not None})
    names = ", ".join(map(str, paths))
    try:
        return validate_config(config)
    except ConfigError as err:
        raise ConfigError(f"{names}: {err}") from None


def job_settings(config: dict, name: str) -> Job:
    """The validated settings of one job, with the cluster-wide launcher settings folded in."""
    if name not in config["jobs"]:
        raise ConfigError(f"job '{name}' is not defined; defined jobs: {', '.join(config['jobs'])}")
    job = copy.deepcopy(config["jobs"][name])
    job["name"] = name
    job["launcher"] = config.get("launcher", "local")
    job["resources"]["slurm"] = {**config.get("slurm", {}), **job["resources"].get("slurm", {})}
    return Job.from_dict(job)

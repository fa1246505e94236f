"""Load and validate config/jobs.yaml: one clear message per mistake, before anything is submitted.

The JSON Schema in workflow/schemas/jobs.schema.yaml is the single source of truth for keys, types
and defaults; the Snakefile applies it with snakemake.utils.validate, stages run standalone apply it
here. What a schema cannot say (min <= max, data on disk, models that build for the data, a GPU job's needs) is
checked below, and defaults that depend on other fields (search.sync_prior, by device) are filled in below.
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from .datacheck import DataError, check_data
from .devices import FIT_DEFAULTS, SYNC_PRIORS, cuda_setup, sync_device, usable_gpus
from .frozen import deep_update, to_plain
from .job import Job, TrainSettings
from .layout import ranks_per_host

SCHEMA_PATH = Path(__file__).resolve().parent.parent / "workflow" / "schemas" / "jobs.schema.yaml"

# Smallest input side each built-in network accepts (its downsampling would reach zero below it): the built-ins
# without model.kwargs are checked by this table, without importing torch; any other model is built and run.
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

# The recipes (a baseline strategy's optimiser, peak rate and warm-up) that warm up, and that scale the rate linearly.
WARMUP_RECIPES = frozenset({"lrs", "lars", "polo"})
LR_SCALING_RECIPES = frozenset({"lrs", "lars"})


def recipe(train: TrainSettings) -> str:
    """The strategy whose optimiser, peak rate and warm-up a run follows: static and ags scale the gradients of
    train.ags.base (sgd, the paper's: plain SGD at lr without warm-up, as lbt), every other strategy its own."""
    if train.strategy in ("static", "ags"):
        return {"sgd": "lbt"}.get(train.ags.base, train.ags.base)
    return train.strategy


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
    job's device (devices.py), and search.gpus_per_node's ends, the node's own GPUs: a schema default cannot
    depend on resources.gpus_per_node."""
    gpus = job["resources"]["gpus_per_node"]
    job["search"]["gpus_per_node"] = {"min": gpus, "max": gpus, **job["search"].get("gpus_per_node", {})}
    prior = job["search"].setdefault("sync_prior", {})
    for kind, terms in SYNC_PRIORS[sync_device(gpus)].items():
        prior[kind] = {**terms, **prior.get(kind, {})}
    for key, value in FIT_DEFAULTS[sync_device(gpus)].items():
        job["search"].setdefault(key, value)


def _bandwidths(prior: dict) -> str:
    """A sync prior's bandwidths, for people: a preset of devices.SYNC_PRIORS, or a job's as plain data."""
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
    data = job.data
    try:
        check_data(data)
    except DataError as err:
        raise ConfigError(f"job '{job.name}': {err}") from None
    if data.val_fraction + data.test_fraction >= 1:
        fail("data", "val_fraction + test_fraction must be below 1")
    model = job.model
    if ":" in model.name or model.kwargs:
        # Built once for the data set's shape and run on two images on the meta device. torch (seconds to import)
        # only here: the built-ins without kwargs are known to build, at MIN_IMAGE_SIZE and above.
        from .data import data_shape
        from .models import ModelError, check_model

        try:
            check_model(model.name, *data_shape(data), data.image_size, model.kwargs)
        except ModelError as err:
            fail(err.field, str(err))
    elif data.image_size < MIN_IMAGE_SIZE[model.name]:
        fail(
            "data.image_size",
            f"{model.name} needs images of at least {MIN_IMAGE_SIZE[model.name]} pixels, got {data.image_size}",
        )
    train, epochs = job.train, job.train.epochs
    late = [m for m in train.lr_milestones if m > epochs]
    if late:
        fail("train.lr_milestones", f"milestones {late} lie beyond the last epoch ({epochs})")
    if recipe(train) in WARMUP_RECIPES and train.warmup_epochs >= epochs:
        fail(
            "train.warmup_epochs",
            f"strategy '{train.strategy}' ({recipe(train)}'s recipe) would warm up for {train.warmup_epochs} "
            f"of {epochs} epochs and never train at its full rate; allowed: below {epochs}",
        )
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
    _check_gpus_per_node(job, fail)
    _check_gpu_job(job, fail)
    _check_batch_schedule(job, fail)


# strategy -> why a batch that follows the noise scale (train.batch_schedule adaptive, batch_schedule.py) makes no
# sense with it
ADAPTIVE_BATCH_REFUSED = {
    "polo": "its local SGD all-reduces no gradients to measure the noise scale with, and its averaging period is "
    "laid out in the first batch's steps"
}


def _check_batch_schedule(job: Job, fail) -> None:
    """train.batch_schedule adaptive needs a strategy it makes sense with (ADAPTIVE_BATCH_REFUSED) and two ranks or
    more, which measure the noise scale it follows."""
    train = job.train
    if train.batch_schedule != "adaptive":
        return
    if train.strategy in ADAPTIVE_BATCH_REFUSED:
        fail(
            "train.batch_schedule",
            f"adaptive with strategy '{train.strategy}': {ADAPTIVE_BATCH_REFUSED[train.strategy]}; allowed: "
            f"fixed, or any strategy but {', '.join(ADAPTIVE_BATCH_REFUSED)}",
        )
    ranks = job.search.nodes.max * max(1, job.search.gpus_per_node.max)
    if ranks < 2:
        fail(
            "train.batch_schedule",
            f"adaptive on at most {ranks} rank (search.nodes.max x search.gpus_per_node.max): the noise scale it "
            f"follows is measured between two ranks or more; allowed: fixed, or search over 2 ranks or more",
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


def _check_gpu_job(job: Job, fail) -> None:
    """What a GPU job needs that a CPU job does not: host memory per GPU rank, NCCL's sync priors, and on the local
    launcher a usable GPU of its own for every rank (`fail`: _check_semantics' error for a field)."""
    gpus, mem_gb = job.resources.gpus_per_node, job.resources.mem_gb
    if gpus and mem_gb < gpus * HOST_GB_PER_GPU_RANK:
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

import json
import os
import sys

from snakemake.exceptions import WorkflowError
from snakemake.utils import validate

from tula_hpc.cli import record_driver, remove_stale_lock
from tula_hpc.config import ConfigError, job_settings, validate_config
from tula_hpc.core.dependencies import stage_settings
from tula_hpc.core.run_layout import profile_name
from tula_hpc.performance import search_modes as search

# Clear, per-field messages first; then Snakemake's own validation against the same schema.
try:
    validate_config(config)
except ConfigError as err:
    raise WorkflowError(f"{', '.join(map(str, workflow.configfiles))}: {err}")
validate(config, "../schemas/jobs.schema.yaml")
# Before Snakemake locks the folder: the lock a killed driver left is removed, so the same command resumes.
remove_stale_lock()

JOBS = list(config["jobs"])
TARGETS = config["targets"] or JOBS  # the jobs `rule all` asks for
# Every stage reads the jobs files as Snakemake read them and the launcher the profile chose from
# the environment, so switching profiles does not count as a change that reruns finished stages.
# The `tula-hpc` console script is the one beside the Python running Snakemake (under --sdm conda the
# environment's own comes first on PATH).
os.environ.update(
    TULA_CONFIGFILES=os.pathsep.join(map(str, workflow.configfiles)),
    TULA_LAUNCHER=config["launcher"],
    TULA_SLURM=json.dumps(config["slurm"]),
    PATH=os.pathsep.join([os.path.dirname(sys.executable), *os.get_exec_path()]),
)


wildcard_constraints:
    job="|".join(JOBS),
    nodes=r"\d+",
    gpus=r"(_G\d+)?",  # a profile's GPUs per node, where they are not the job's own (tula_hpc.core.run_layout.profile_name)
    batch=r"\d+",


def settings(stage):
    """What `stage` depends on (tula_hpc.core.dependencies.STAGE_SETTINGS) as a rule's params: editing one of those
    settings reruns that stage and what follows, editing anything else (say, epochs before training) does not."""
    return lambda wildcards: stage_settings(config["jobs"][wildcards.job], stage)


def planned_profiles(wildcards):
    plan_file = checkpoints.plan.get(job=wildcards.job).output[0]
    with open(plan_file) as handle:
        planned = json.load(handle)["profile"]
    job = job_settings(config, wildcards.job)
    return [f"results/{wildcards.job}/profile/{profile_name(c, job)}.json" for c in planned]


def adaptive_manifest(wildcards):
    """adaptive.json, the profiles the search added beyond the plan, when it adds any (adaptive search, or the
    profiles that confirm the choice)."""
    settings = job_settings(config, wildcards.job).search
    if search.adds_profiles(settings.mode, settings.confirm):
        return [f"results/{wildcards.job}/adaptive.json"]
    return []


def batch_schedule_model(wildcards):
    """perfmodel.json, whose candidates train.batch_schedule adaptive chooses among as training goes (none fixed)."""
    if job_settings(config, wildcards.job).train.batch_schedule == "adaptive":
        return [f"results/{wildcards.job}/perfmodel.json"]
    return []


def chosen_nodes(wildcards, input):
    """Processes the local launcher starts for training (1 while the selection is still unknown)."""
    try:
        with open(input.selection) as handle:
            return int(json.load(handle)["chosen"]["nodes"])
    except FileNotFoundError:
        return 1


def release_measuring_allocations():
    """On the way out of a failure no measuring allocation keeps its nodes
    (tula_hpc.cluster.allocation.release_allocation)."""
    from tula_hpc.cluster.allocation import release_allocation

    for job in JOBS:
        release_allocation(os.path.join("work", job))

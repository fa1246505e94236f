"""How resources.slurm becomes Slurm options: one home for the per-stage sbatch job (submitit's parameters,
launchers/slurm.py), the measuring allocation's holder and `sbatch --test-only` (partition.sbatch_args), and a
measuring step's srun (launchers/shared_allocation.py), so that the three ask Slurm for the same job.

Options are kept by sbatch's long names, a bare flag as True; `extra_args` is split as a shell would (shlex), so
"-p gpu" is one option of two words, and a short option is written by its long name (sbatch(1)).
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Iterable

from tula_hpc.core.job import SlurmSettings

# sbatch(1)'s short options: (long name, whether it takes a value). -h and -V only print.
SHORT_OPTIONS = {
    "-A": ("account", True),
    "-a": ("array", True),
    "-b": ("begin", True),
    "-B": ("extra-node-info", True),
    "-c": ("cpus-per-task", True),
    "-C": ("constraint", True),
    "-d": ("dependency", True),
    "-D": ("chdir", True),
    "-e": ("error", True),
    "-F": ("nodefile", True),
    "-G": ("gpus", True),
    "-H": ("hold", False),
    "-i": ("input", True),
    "-J": ("job-name", True),
    "-k": ("no-kill", False),
    "-L": ("licenses", True),
    "-m": ("distribution", True),
    "-M": ("clusters", True),
    "-n": ("ntasks", True),
    "-N": ("nodes", True),
    "-o": ("output", True),
    "-O": ("overcommit", False),
    "-p": ("partition", True),
    "-q": ("qos", True),
    "-Q": ("quiet", False),
    "-s": ("oversubscribe", False),
    "-S": ("core-spec", True),
    "-t": ("time", True),
    "-v": ("verbose", False),
    "-w": ("nodelist", True),
    "-W": ("wait", False),
    "-x": ("exclude", True),
}
# Options the project sets from the job itself, which an extra argument would contradict -> where they are set.
PROJECT_OPTIONS = {
    "nodes": "search.nodes (the plan's candidates)",
    "ntasks": "resources.gpus_per_node (one task per GPU)",
    "ntasks-per-node": "resources.gpus_per_node (one task per GPU)",
    "cpus-per-task": "resources.cpus_per_task",
    "time": "resources.time_min and resources.time_limit",
    "mem": "resources.mem_gb",
    "mem-per-gpu": "resources.slurm.mem_per_gpu_gb",
    "mem-per-cpu": "resources.mem_gb",
    "gpus": "resources.gpus_per_node",
    "gpus-per-node": "resources.gpus_per_node and resources.slurm.gpu_type",
    "gpus-per-task": "resources.slurm.gpu_binding",
    "no-requeue": "the project, which asks --requeue (training resumes from its checkpoint)",
    "job-name": "the stage",
    "output": "submitit (its log files)",
    "error": "submitit (its log files)",
    "open-mode": "submitit (its log files)",
    "signal": "the launcher (the warning before the time limit)",
    "array": "the launcher",
    "wrap": "the launcher",
}


class SlurmOptionError(ValueError):
    """resources.slurm.extra_args holds what is not an sbatch option the project can pass; `reason` says why."""

    def __init__(self, reason: str):
        super().__init__(f"resources.slurm.extra_args: {reason}")
        self.reason = reason


def _one_option(tokens: list[str], at: int) -> tuple[str, str | bool, int]:
    """The option that starts at tokens[at] (long name, value or True for a bare flag) and where the next starts."""
    token = tokens[at]
    following = tokens[at + 1] if at + 1 < len(tokens) else None
    if token.startswith("--") and len(token) > 2:
        name, has_value, value = token[2:].partition("=")
        if has_value:
            return name, value, at + 1
        if following is not None and not following.startswith("-"):  # "--partition gpu"
            return name, following, at + 2
        return name, True, at + 1
    if token[:2] not in SHORT_OPTIONS:
        known = " ".join(sorted(SHORT_OPTIONS, key=str.lower))
        raise SlurmOptionError(
            f"{token!r} is not an sbatch option the project knows; allowed: --long-name[=value], or {known}"
        )
    name, takes_value = SHORT_OPTIONS[token[:2]]
    attached = token[2:]
    if not takes_value:
        if attached:
            raise SlurmOptionError(f"{token!r}: -{token[1]} (--{name}) takes no value")
        return name, True, at + 1
    if attached:  # "-pgpu"
        return name, attached, at + 1
    if following is None:
        raise SlurmOptionError(f"{token!r} (--{name}) needs a value")
    return name, following, at + 2


def extra_options(extra_args: Iterable[str]) -> dict[str, str | bool]:
    """resources.slurm.extra_args as options by long name, split as a shell would ("--wckey=" an empty value);
    an option given twice keeps its last value, as sbatch does."""
    tokens = []
    for arg in extra_args:
        try:
            tokens += shlex.split(arg)
        except ValueError as err:
            raise SlurmOptionError(f"{arg!r} does not split as a shell would ({err})") from None
    options, at = {}, 0
    while at < len(tokens):
        if not tokens[at].startswith("-") or tokens[at] in ("-", "--"):
            raise SlurmOptionError(f"{tokens[at]!r} follows no option that takes it; write --option=value")
        name, value, at = _one_option(tokens, at)
        if name in PROJECT_OPTIONS:
            raise SlurmOptionError(f"--{name} is set by {PROJECT_OPTIONS[name]}; set it there")
        options[name] = value
    return options


def megabytes(gb: float) -> str:
    return f"{math.ceil(gb * 1024)}M"


def resource_options(slurm: SlurmSettings, gpus_per_node: int, mem_gb: float) -> dict[str, str]:
    """The GPUs (typed where resources.slurm.gpu_type says, per node or bound per task) and the host memory (per
    node, or per GPU where resources.slurm.mem_per_gpu_gb says and there are GPUs) of a job or step."""
    options = {}
    if gpus_per_node:
        typed = f"{slurm.gpu_type}:" if slurm.gpu_type else ""
        if slurm.gpu_binding == "task":
            options["gpus-per-task"] = f"{typed}1"  # one task per GPU on every node, each bound to its own
        else:
            options["gpus-per-node"] = f"{typed}{gpus_per_node}"
    if gpus_per_node and slurm.mem_per_gpu_gb is not None:
        options["mem-per-gpu"] = megabytes(slurm.mem_per_gpu_gb)
    else:
        options["mem"] = megabytes(mem_gb)
    return options


def site_options(slurm: SlurmSettings) -> dict[str, str | bool]:
    """What the site's jobs must say beside their resources: resources.slurm's named keys, then its extra_args.
    --requeue always: where a site's default is JobRequeue=0, submitit's `scontrol requeue` at the time-limit
    warning (and a requeue after preemption or a lost node) would fail."""
    named = {
        "partition": slurm.partition,
        "account": slurm.account,
        "qos": slurm.qos,
        "constraint": slurm.constraint,
        "reservation": slurm.reservation,
        "wckey": slurm.wckey,
    }
    options: dict[str, str | bool] = {"requeue": True}
    options.update({name: value for name, value in named.items() if value is not None})
    return {**options, **extra_options(slurm.extra_args or ())}


def as_arguments(options: dict[str, str | bool | int]) -> list[str]:
    """Options as command-line words: --name=value, a bare flag --name."""
    return [f"--{name}" if value is True else f"--{name}={value}" for name, value in options.items()]


def with_setup(setup: Iterable[str] | None, command: list[str]) -> list[str]:
    """`command` run after resources.slurm.setup's lines in one shell (their `module load` and exports hold for
    it); its words stay last, so the command is still known by them."""
    lines = list(setup or ())
    if not lines:
        return command
    return ["bash", "-c", "\n".join([*lines, 'exec "$@"']), "tula-setup", *command]

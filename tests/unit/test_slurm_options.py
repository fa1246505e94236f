"""How resources.slurm becomes Slurm options: extra arguments split as a shell would, short options by their long
names, the GPUs typed or bound per task, memory per GPU, the site's keys, setup lines before a command."""

from __future__ import annotations

import subprocess

import pytest

from tula_hpc.cluster.slurm_options import (
    SlurmOptionError,
    as_arguments,
    extra_options,
    resource_options,
    site_options,
    with_setup,
)
from tula_hpc.core.job import SlurmSettings


def test_extra_arguments_split_as_a_shell_would_with_short_options_by_their_long_names():
    options = extra_options(["-p gpu", "--exclusive", "--wckey=", "--comment 'two words'", "-Aproj", "-s"])
    assert options == {
        "partition": "gpu",
        "exclusive": True,
        "wckey": "",
        "comment": "two words",
        "account": "proj",
        "oversubscribe": True,
    }
    assert as_arguments(options) == [
        "--partition=gpu",
        "--exclusive",
        "--wckey=",
        "--comment=two words",
        "--account=proj",
        "--oversubscribe",
    ]
    assert extra_options(["-p", "gpu", "--partition=big"]) == {"partition": "big"}  # the last one holds, as in sbatch


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["-Z 3"], "'-Z' is not an sbatch option the project knows"),
        (["-p"], "'-p' (--partition) needs a value"),
        (["-sX"], "-s (--oversubscribe) takes no value"),
        (["gpu"], "'gpu' follows no option that takes it"),
        (["--comment 'open"], "does not split as a shell would"),
        (["-N 2"], "--nodes is set by search.nodes"),
        (["--cpus-per-task=8"], "--cpus-per-task is set by resources.cpus_per_task"),
        (["--mem=10G"], "--mem is set by resources.mem_gb"),
        (["--no-requeue"], "--no-requeue is set by the project, which asks --requeue"),
    ],
)
def test_what_is_not_an_option_the_project_can_pass_is_named(extra, says):
    with pytest.raises(SlurmOptionError) as err:
        extra_options(extra)
    assert str(err.value).startswith("resources.slurm.extra_args: ") and says in str(err.value), str(err.value)


def test_gpus_are_typed_and_per_node_or_bound_one_per_task():
    assert resource_options(SlurmSettings(), 4, 16) == {"gpus-per-node": "4", "mem": "16384M"}
    typed = SlurmSettings(gpu_type="a100")
    assert resource_options(typed, 4, 16)["gpus-per-node"] == "a100:4"
    per_task = resource_options(SlurmSettings(gpu_type="a100", gpu_binding="task"), 4, 16)
    assert per_task["gpus-per-task"] == "a100:1" and "gpus-per-node" not in per_task
    assert resource_options(typed, 0, 2) == {"mem": "2048M"}  # a CPU job asks for no GPU, typed or not


def test_memory_is_per_gpu_where_asked_and_the_job_has_gpus():
    slurm = SlurmSettings(mem_per_gpu_gb=12)
    assert resource_options(slurm, 2, 64) == {"gpus-per-node": "2", "mem-per-gpu": "12288M"}
    assert resource_options(slurm, 0, 4) == {"mem": "4096M"}  # a CPU job: per node


def test_the_site_options_ask_requeue_and_name_what_was_given():
    assert site_options(SlurmSettings()) == {"requeue": True}  # no wckey at all where none is given
    slurm = SlurmSettings(partition="gpu", reservation="maint", wckey="proj7", extra_args=("-p big",))
    assert site_options(slurm) == {"requeue": True, "partition": "big", "reservation": "maint", "wckey": "proj7"}


@pytest.mark.spawns
def test_setup_lines_run_before_the_command_in_its_shell_and_the_command_stays_last():
    command = ["printenv", "SETUP_SAYS"]
    wrapped = with_setup(["export SETUP_SAYS=ready", "true"], command)
    assert wrapped[-2:] == command
    assert subprocess.run(wrapped, capture_output=True, text=True, check=True).stdout == "ready\n"
    assert with_setup(None, command) == command

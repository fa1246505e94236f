"""launchers/interface: how a failed job is told (the ranks' last stderr lines, read via submitit's API) and the
process checks the launchers share."""

from __future__ import annotations

import subprocess

import pytest
import submitit
from submitit.core.utils import cloudpickle_dump

from tests.conftest import wait_for
from tula_hpc.cluster.launch_spec import LaunchSpec
from tula_hpc.cluster.launchers import interface


@pytest.mark.parametrize("tasks", [1, 3])
def test_a_failed_job_names_its_state_and_log_and_shows_every_ranks_last_stderr_lines(tmp_path, tasks):
    job = submitit.SlurmJob(folder=tmp_path, job_id="42", tasks=range(tasks))
    for rank in range(tasks):
        paths = job.task(rank).paths
        paths.stderr.parent.mkdir(parents=True, exist_ok=True)
        paths.stderr.write_text("".join(f"rank {rank} line {i}\n" for i in range(100)))
    tail = interface._stderr_tail(job)
    assert [f"rank {rank} line 99" in tail for rank in range(tasks)] == [True] * tasks
    assert "line 59\n" not in tail and f"line {100 - interface.STDERR_TAIL_LINES}\n" in tail
    message = str(interface.failed(job, LaunchSpec("slurm"), "train", "TIMEOUT", "no result"))
    assert message.startswith(f"train: slurm job 42 ended TIMEOUT; read {job.paths.stderr}\n")
    assert message.endswith(f"{tail}\nno result")


def test_a_rank_ended_well_only_where_it_left_a_successful_result(tmp_path):
    job = submitit.SlurmJob(folder=tmp_path, job_id="42", tasks=range(3))
    cloudpickle_dump(("success", 5), job.task(0).paths.result_pickle)
    cloudpickle_dump(("error", "Traceback"), job.task(1).paths.result_pickle)
    assert [interface.ended_well(job, rank) for rank in range(3)] == [True, False, False]


@pytest.mark.spawns
def test_a_process_that_ended_is_not_alive_though_its_parent_has_not_reaped_it(tmp_path):
    ending = subprocess.Popen(["sleep", "0.2"])
    assert interface.pid_alive(ending.pid)
    wait_for(lambda: not interface.pid_alive(ending.pid), 10, "the process to end (a zombie until reaped)")
    ending.wait()
    assert not interface.pid_alive(ending.pid)

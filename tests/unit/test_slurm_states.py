"""slurm_states: squeue's and sacct's words parsed from recorded output; the waits for accounting, on fake commands.

tests/unit/data/slurm/*.txt were recorded on the local cluster by tests/unit/data/slurm/capture.sh.
"""

from __future__ import annotations

import datetime
import itertools
from pathlib import Path

import pytest

from tests.conftest import fake_commands
from tula_hpc.cluster import slurm_states

RECORDED = Path(__file__).parent / "data" / "slurm"


def _recorded(name: str) -> str:
    return (RECORDED / name).read_text()


@pytest.mark.parametrize(
    "job, state",
    [("pending", "PENDING"), ("running", "RUNNING"), ("completed", None), ("timeout", None), ("oom", None)],
)
def test_squeue_gives_the_state_while_slurm_holds_the_job(job, state):
    assert slurm_states.parse_squeue_state(_recorded(f"{job}.squeue.txt")) == state


@pytest.mark.parametrize(
    "job, state",
    [
        ("pending", None),
        ("running", None),
        ("completed", "COMPLETED"),
        ("failed", "FAILED"),
        ("oom", "OUT_OF_MEMORY"),  # the allocation says FAILED, its step OUT_OF_MEMORY
        ("cancelled", "CANCELLED"),  # "CANCELLED by 0"
        ("timeout", "TIMEOUT"),  # its steps say CANCELLED
    ],
)
def test_sacct_gives_how_the_job_ended_and_the_cause_from_a_step(job, state):
    assert slurm_states.parse_sacct_states(_recorded(f"{job}.sacct.txt")) == state


def test_sacct_without_the_job_yet_is_not_an_end():
    assert slurm_states.parse_sacct_states("") is None


def test_a_completed_allocation_is_completed_whatever_a_step_says():
    assert slurm_states.parse_sacct_states("COMPLETED\nCOMPLETED\nCANCELLED by 0\n") == "COMPLETED"


@pytest.mark.spawns
def test_slurm_state_waits_for_accounting_to_learn_of_the_end(tmp_path, monkeypatch):
    """squeue has forgotten the job; sacct knows nothing twice, then the recorded out-of-memory job."""
    count = tmp_path / "count"
    log = fake_commands(
        tmp_path,
        monkeypatch,
        squeue="exit 0",
        sacct=f'echo x >>{count}; [ "$(wc -l <{count})" -gt 2 ] && cat {RECORDED / "oom.sacct.txt"}; exit 0',
    )
    monkeypatch.setattr(slurm_states, "ACCOUNTING_POLL_S", 0.01)
    assert slurm_states.slurm_state("42") == "OUT_OF_MEMORY"
    assert log.read_text().splitlines() == ["squeue -h -j 42 -o %T"] + ["sacct -n -P -j 42 -o State"] * 3


@pytest.mark.spawns
def test_slurm_state_gives_up_waiting_for_accounting(tmp_path, monkeypatch):
    fake_commands(tmp_path, monkeypatch, squeue="echo 'slurm_load_jobs error: Invalid job id' >&2; exit 1", sacct="")
    monkeypatch.setattr(slurm_states, "ACCOUNTING_LAG_S", 0.05)
    monkeypatch.setattr(slurm_states, "ACCOUNTING_POLL_S", 0.01)
    assert slurm_states.slurm_state("42") == "UNKNOWN"


SACCT_STEPS = """job-allocation|RUNNING
batch|RUNNING
extern|RUNNING
job-profile-N1-B32|FAILED
job-probe-memory|COMPLETED
job-profile-N1-B32|OUT_OF_MEMORY
job-profile-N2-B32|RUNNING
"""


def test_a_steps_end_is_its_last_run_in_accounting():
    assert slurm_states.parse_step_state(SACCT_STEPS, "job-profile-N1-B32") == "OUT_OF_MEMORY"
    assert slurm_states.parse_step_state(SACCT_STEPS, "job-profile-N2-B32") is None  # still running
    assert slurm_states.parse_step_state(SACCT_STEPS, "job-profile-N2-B64") is None  # not in accounting yet


def test_a_job_is_found_by_the_folder_submitit_wrote_its_batch_script_into():
    """`squeue -h --name=NAME -o %i|%o` as the local cluster printed it for a submitit job (its script path)."""
    listed = "536|/w/work/j/train/submit-20261125-0730-aa11bb/.submission_file_7ec4fe65.sh\n"
    listed += "537|/w/work/j/train/submit-20261125-0731-cc22dd/.submission_file_0d9e1f22.sh\n"
    assert slurm_states.parse_submitted_from(listed, "submit-20261125-0731-cc22dd") == "537"
    assert slurm_states.parse_submitted_from(listed, "submit-20261125-0732-ee33ff") is None
    assert slurm_states.parse_submitted_from("", "submit-20261125-0731-cc22dd") is None


@pytest.mark.spawns
def test_a_cancel_is_tried_again_while_slurmctld_does_not_answer_and_fails_naming_the_command(tmp_path, monkeypatch):
    """scancel fails while slurmctld restarts: the allocation must not be left holding its nodes."""
    count, refused = tmp_path / "count", 'echo "Unable to contact slurm controller" >&2; exit 1'
    log = fake_commands(
        tmp_path,
        monkeypatch,
        scancel=f'echo x >>{count}; [ "$(wc -l <{count})" -ge 3 ] || {{ {refused}; }}',
        squeue="exit 1",  # slurmctld away: accounting says the job runs
        sacct="echo RUNNING",
    )
    monkeypatch.setattr(slurm_states, "CANCEL_POLL_S", 0.01)
    monkeypatch.setattr(slurm_states, "ACCOUNTING_LAG_S", 0.01)
    slurm_states.cancel("90")
    assert log.read_text().count("scancel 90") == 3
    count.unlink()
    monkeypatch.setattr(slurm_states, "CANCEL_PATIENCE_S", 0.0)
    with pytest.raises(
        slurm_states.CancelFailed, match=r"slurm job 90 could not be cancelled .*controller.*`scancel 90`"
    ):
        slurm_states.cancel("90")


@pytest.mark.spawns
def test_slurm_state_asks_again_with_backoff_while_slurmctld_does_not_answer(tmp_path, monkeypatch, capsys):
    """squeue and sacct both fail twice (slurmctld restarting): not UNKNOWN (on which a live job would be given up),
    but asked again, saying so, until squeue answers."""
    count, away = tmp_path / "count", 'echo "slurm_load_jobs error: Unable to contact slurm controller" >&2; exit 1'
    fake_commands(
        tmp_path,
        monkeypatch,
        squeue=f'echo x >>{count}; [ "$(wc -l <{count})" -le 2 ] && {{ {away}; }}; echo RUNNING',
        sacct='echo "sacct: error: Problem talking to the database" >&2; exit 1',
    )
    monkeypatch.setattr(slurm_states, "BACKOFF_FIRST_S", 0.01)
    assert slurm_states.slurm_state("42") == "RUNNING"
    said = capsys.readouterr().out
    assert said.count("slurmctld does not answer (slurm_load_jobs error: Unable to contact slurm controller)") == 2


@pytest.mark.spawns
def test_a_step_is_not_taken_for_ended_while_slurmctld_does_not_answer(tmp_path, monkeypatch, capsys):
    """A re-attached measurement's wait ends when its step is no longer listed: a failed squeue is not that."""
    count, away = tmp_path / "count", 'echo "slurm_load_jobs error: Unable to contact slurm controller" >&2; exit 1'
    fake_commands(
        tmp_path,
        monkeypatch,
        squeue=f'echo x >>{count}; [ "$(wc -l <{count})" -le 2 ] && {{ {away}; }}; echo profile-n1',
    )
    monkeypatch.setattr(slurm_states, "BACKOFF_FIRST_S", 0.01)
    assert slurm_states.step_running("42", "profile-n1")
    assert capsys.readouterr().out.count("allocation 42's steps asked again") == 2


def test_polls_back_off_from_2_s_doubling_to_a_minute():
    assert list(itertools.islice(slurm_states.backoff(), 7)) == [2, 4, 8, 16, 32, 60, 60]
    assert list(itertools.islice(slurm_states.backoff(most_s=30), 6)) == [2, 4, 8, 16, 30, 30]


def test_a_start_time_reads_as_squeue_prints_it_and_none_before_one():
    started = datetime.datetime(2026, 11, 28, 7, 53, 42).timestamp()
    assert slurm_states.parse_start_time("2026-11-28T07:53:42\n") == started
    assert slurm_states.parse_start_time("N/A") is None and slurm_states.parse_start_time("") is None


def test_the_preempt_time_says_whether_slurm_chose_the_job_for_preemption():
    shown = "JobId=7 JobName=x PreemptEligibleTime=2026-11-28T08:55:05 PreemptTime=2026-11-28T08:55:40 SuspendTime=None"
    assert slurm_states.parse_preempt_time(shown) == "2026-11-28T08:55:40"
    assert slurm_states.parse_preempt_time(shown.replace("PreemptTime=2026-11-28T08:55:40", "PreemptTime=None")) is None

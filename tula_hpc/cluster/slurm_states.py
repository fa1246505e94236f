"""What Slurm says of a job and of its steps (squeue while it holds them, accounting once they ended), asked again
while slurmctld does not answer, and cancelling one so that it is cancelled."""

from __future__ import annotations

import datetime
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

ACTIVE_SLURM_STATES = {
    "PENDING",
    "RUNNING",
    "REQUEUED",
    "CONFIGURING",
    "COMPLETING",
    "RESIZING",
    "SUSPENDED",
    "REQUEUE_HOLD",
    "REQUEUE_FED",
    "SIGNALING",
    "STAGE_OUT",
}
FAILURE_CAUSES = ("OUT_OF_MEMORY", "NODE_FAIL", "PREEMPTED", "TIMEOUT", "DEADLINE", "CANCELLED")
# Ends that come from under the work, not from it: preempted (PreemptMode=CANCEL), its time limit reached where the
# job was not requeued (JobRequeue=0), a lost node or one that failed to boot. The work runs again in a new job,
# resuming from its checkpoint. (DEADLINE is not among them: a new job would meet the same --deadline.)
ENDED_UNDER_THE_WORK = ("PREEMPTED", "TIMEOUT", "NODE_FAIL", "BOOT_FAIL")
NOT_IN_QUEUE = "Invalid job id"  # squeue's error for a job it has forgotten, from a controller that answers
BACKOFF_FIRST_S, BACKOFF_MAX_S = 2.0, 60.0
CANCEL_PATIENCE_S, CANCEL_POLL_S = 600, 5.0  # scancel tried again while slurmctld does not answer
ACCOUNTING_LAG_S = 15  # sacct learns of a job's end a few seconds after squeue forgets it
ACCOUNTING_POLL_S = 1
SETTLE_POLL_S = 2


def parse_squeue_state(text: str) -> str | None:
    """The state `squeue -h -j ID -o %T` prints, or None once Slurm has forgotten the job."""
    return text.split()[0] if text.strip() else None


def _sacct_states(text: str) -> list[str]:
    """`sacct -n -P -j ID -o State`: the allocation's state, then its steps' ("CANCELLED by 0" is CANCELLED)."""
    return [line.split()[0] for line in text.splitlines() if line.strip()]


def parse_sacct_states(text: str) -> str | None:
    """How the job ended, or None while accounting has it active or does not know it yet.

    A failed allocation often just says FAILED; the cause (OUT_OF_MEMORY, NODE_FAIL, ...) is on a step.
    """
    states = _sacct_states(text)
    if not states or states[0] in ACTIVE_SLURM_STATES:
        return None
    if states[0] == "COMPLETED":
        return "COMPLETED"
    return next((cause for cause in FAILURE_CAUSES if cause in states), states[0])


def parse_step_state(text: str, step_name: str) -> str | None:
    """How the last step named `step_name` ended, from `sacct -n -P -j ID -o JobName,State` (steps in the order they
    ran); None while it is active or accounting has not got it."""
    rows = (line.partition("|") for line in text.splitlines())
    states = [state.split()[0] for name, _, state in rows if name == step_name]
    return states[-1] if states and states[-1] not in ACTIVE_SLURM_STATES else None


def parse_submitted_from(text: str, folder_name: str) -> str | None:
    """The job among `squeue -h -o %i|%o` lines whose batch script (submitit writes it into the job's folder) lies
    in a folder named `folder_name`."""
    for line in text.splitlines():
        job_id, _, command = line.partition("|")
        if f"/{folder_name}/" in command:
            return job_id.strip()
    return None


def submitted_from(name: str, folder: str) -> str | None:
    """The active job named `name` that was submitted from `folder`: found by a rerun whose driver was killed after
    sbatch and before it recorded the job's id."""
    listed = subprocess.run(["squeue", "-h", f"--name={name}", "-o", "%i|%o"], capture_output=True, text=True)
    return parse_submitted_from(listed.stdout, Path(folder).name)


def step_running(job_id: str, step_name: str) -> bool:
    """Whether allocation `job_id` runs a step named `step_name` (`squeue --steps` lists the running ones). While
    slurmctld does not answer, asked again with backoff: a step is not taken for ended on missing information."""
    pauses = backoff()
    while True:
        listed = subprocess.run(["squeue", "-h", "-s", "-j", job_id, "-o", "%j"], capture_output=True, text=True)
        if listed.returncode == 0 or NOT_IN_QUEUE.lower() in listed.stderr.lower():
            return step_name in listed.stdout.split()
        _say_controller_away(listed.stderr, f"allocation {job_id}'s steps", pause := next(pauses))
        time.sleep(pause)


def parse_start_time(text: str) -> float | None:
    """Epoch seconds of `squeue -o %S`'s start (local time, e.g. 2026-11-28T07:53:42); None for N/A or nothing."""
    try:
        return datetime.datetime.fromisoformat(text.strip()).timestamp()
    except ValueError:
        return None


def parse_preempt_time(text: str) -> str | None:
    """`scontrol show job -o ID`'s PreemptTime: when Slurm chose the job for preemption (None: it has not)."""
    found = re.search(r"\bPreemptTime=(\S+)", text)
    return found.group(1) if found and found.group(1) not in ("None", "Unknown") else None


def being_preempted(job_id: str) -> bool:
    """Whether Slurm chose the running job for preemption: under PreemptMode=CANCEL it runs on for the partition's
    GraceTime, its steps already signalled, and then ends PREEMPTED."""
    shown = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True)
    return shown.returncode == 0 and parse_preempt_time(shown.stdout) is not None


def run_started(job_id: str) -> float | None:
    """When the job's current run started (a requeued job's latest start), while Slurm holds it."""
    listed = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%S"], capture_output=True, text=True)
    return parse_start_time(listed.stdout) if listed.returncode == 0 else None


def step_state(job_id: str, step_name: str) -> str:
    """How the last step named `step_name` of allocation `job_id` ended; FAILED where accounting does not say."""
    deadline = time.time() + ACCOUNTING_LAG_S
    while True:
        acct = subprocess.run(
            ["sacct", "-n", "-P", "-j", job_id, "-o", "JobName,State"], capture_output=True, text=True
        )
        state = parse_step_state(acct.stdout, step_name)
        if state is not None or time.time() > deadline:
            return state or "FAILED"
        time.sleep(ACCOUNTING_POLL_S)


def backoff(most_s: float | None = None) -> Iterator[float]:
    """Pauses between polls: BACKOFF_FIRST_S, doubling up to `most_s` (BACKOFF_MAX_S), for ever."""
    pause, most_s = BACKOFF_FIRST_S, most_s or BACKOFF_MAX_S
    while True:
        yield min(pause, most_s)
        pause = min(2 * pause, most_s)


def _accounting_state(job_id: str) -> str | None:
    """How accounting says the job ended, waiting ACCOUNTING_LAG_S for it to learn of the end; the state it lists
    where it does not say an end; None where sacct fails or does not know the job."""
    deadline = time.time() + ACCOUNTING_LAG_S
    while True:
        acct = subprocess.run(["sacct", "-n", "-P", "-j", job_id, "-o", "State"], capture_output=True, text=True)
        if acct.returncode != 0:
            return None
        state = parse_sacct_states(acct.stdout)
        if state is not None:
            return state
        if time.time() > deadline:
            return next(iter(_sacct_states(acct.stdout)), None)
        time.sleep(ACCOUNTING_POLL_S)


def slurm_state(job_id: str) -> str:
    """The job's state from squeue while Slurm holds it, else from accounting (sacct), else UNKNOWN where
    slurmctld answered that it does not hold the job. While neither answers (slurmctld restarting), asked again
    with backoff, saying so: nothing is decided on missing information."""
    pauses = backoff()
    while True:
        queued = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True)
        state = parse_squeue_state(queued.stdout) if queued.returncode == 0 else None
        if state is None:
            state = _accounting_state(job_id)
        if state is not None:
            return state
        if queued.returncode == 0 or NOT_IN_QUEUE.lower() in queued.stderr.lower():
            return "UNKNOWN"
        _say_controller_away(queued.stderr, f"job {job_id}'s state", pause := next(pauses))
        time.sleep(pause)


def _say_controller_away(stderr: str, asked: str, pause: float) -> None:
    error = (stderr.strip().splitlines() or ["no answer"])[-1]
    print(f"[tula-hpc] slurmctld does not answer ({error}): {asked} asked again in {pause:.0f} s", flush=True)


def settled_state(job_id: str) -> str:
    """The job's state once it is no longer completing: a job requeued (preempted, scontrol requeue) completes
    before it is pending again, one that ended completes before it is gone."""
    while (state := slurm_state(job_id)) in ("COMPLETING", "STAGE_OUT"):
        time.sleep(SETTLE_POLL_S)
    return state


class CancelFailed(RuntimeError):
    """A job could not be cancelled; the message names the command to run."""


def cancel(job_id: str) -> None:
    """scancel, until it has worked or the job has ended. While slurmctld is away (restarted, failing over) scancel
    fails; an allocation left running would hold its nodes, and the train job would wait behind it (bench/chaos.py
    found it). CancelFailed after CANCEL_PATIENCE_S."""
    deadline = time.time() + CANCEL_PATIENCE_S
    while True:
        tried = subprocess.run(["scancel", job_id], capture_output=True, text=True)
        if tried.returncode == 0 or slurm_state(job_id) not in ACTIVE_SLURM_STATES:
            return
        if time.time() > deadline:
            raise CancelFailed(
                f"slurm job {job_id} could not be cancelled in {CANCEL_PATIENCE_S} s ({tried.stderr.strip()}): "
                f"is slurmctld answering? Cancel it with `scancel {job_id}`"
            )
        time.sleep(CANCEL_POLL_S)


def controller_answers() -> bool:
    """Whether slurmctld answers (`scontrol ping` exits 0 when it does): a failed Slurm command is worth trying
    again only while it does not, as when it restarts or fails over."""
    try:
        return subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False

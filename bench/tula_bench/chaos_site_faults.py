"""The faults bench/chaos_sites.py adds to bench/chaos_faults.py's, as a real site's settings make them (issue 56);
each lands at a moment `at` (epoch seconds) and returns where it landed (None if the run ended first):
- preempt_cancel_train, preempt_cancel_profile: a job of partition URGENT (higher PriorityTier, same nodes) asks for
  every node the run's train job (or its measuring allocation while a profile runs) holds; under PreemptMode=CANCEL
  that job ends PREEMPTED. The urgent job is cancelled once it has started (or after URGENT_WAIT_S);
- time_limit_requeue_off: nothing is done to the run; its jobs file (TIME_LIMIT_CHANGES) gives training a limit it
  reaches, and with JobRequeue=0 the train job ends TIMEOUT: the fault lands when Slurm records that end (or a
  requeue, where the job asked for one);
- admin_hold: the nodes taken by a job of another name, so that the run's next job pends; that job held
  (`scontrol hold`, as an administrator), the nodes freed, and the job released HOLD_S later. Whether it ended
  CANCELLED before its release is recorded (`held_cancelled`): a held job is the site's to release, not ours;
- restart_slurmctld_pending: chaos_faults.restart_slurmctld's outage while a job of the run pends (made to pend as
  for admin_hold); the existing restart_slurmctld is the outage while one runs;
- late_results: a finished job's result pickle (submitit's *_result.pkl) hidden for LAG_S after it appears, then
  put back, as a shared file system that shows a compute node's file late.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tula_bench.chaos_faults import (
    POLL_S,
    hold,
    job_nodes,
    moment,
    our_jobs,
    restart_slurmctld,
    slurmctld_outage,
    wait_until,
)
from tula_hpc.cluster import slurm_states

RUN_PARTITION = "debug"  # profiles/slurm's partition, the run's jobs'
URGENT = "urgent"  # the strict profile's preempting partition
URGENT_WAIT_S = 90  # the urgent job starts within GraceTime (about 20 s) and KillWait of its asking
HOLD_S = 30  # an administrator's hold lasts this long
LAG_S = 20  # a result file shows this late
BLOCKER_S = 900  # the job of another name that makes the run's next job pend lives at most this long
TIME_LIMIT_CHANGES = {"resources": {"time_limit": "fixed", "time_min": 1}}  # Slurm's smallest limit, one minute
LIMIT_STATES = {"TIMEOUT", "REQUEUED"}  # the train job reached its limit (ended, or was requeued where it asked)


def sbatch(*args: str) -> str:
    """A job of the bench's own (never named like the run's, so our_jobs does not see it); its id."""
    done = subprocess.run(["sbatch", "--parsable", *args], capture_output=True, text=True, check=True)
    return done.stdout.strip().split(";")[0]


def squeue_state(job_id: str) -> str | None:
    out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True).stdout
    return slurm_states.parse_squeue_state(out)


def training_job(workdir: Path, name: str, job_name: str) -> bool:
    return job_name == f"{name}-train"


def profiling_job(workdir: Path, name: str, job_name: str) -> bool:
    """The job a profile runs in (the measuring allocation, or its own job with per_stage allocation) while one of
    the run's profiles is under way: its folder exists, its result does not yet."""
    measuring = job_name == f"{name}-allocation" or job_name.startswith(f"{name}-profile-")
    return measuring and profile_under_way(workdir, name)


def profile_under_way(workdir: Path, name: str) -> bool:
    folders = (workdir / "work" / name / "profile").glob("N*")
    return any(not (workdir / "results" / name / "profile" / f"{f.name}.json").exists() for f in folders if f.is_dir())


def running_job_of(workdir: Path, name: str, pick) -> list[tuple[str, str, list[str]]]:
    """(job id, job name, its nodes) of the run's running jobs that `pick` chooses."""
    return [(i, n, nodes) for i, n in our_jobs(name) if pick(workdir, name, n) and (nodes := job_nodes(i))]


def preempt(driver, workdir: Path, name: str, at: float, started: float, pick) -> dict | None:
    jobs = wait_until(driver, at, lambda: running_job_of(workdir, name, pick))
    if jobs is None:
        return None
    job_id, job_name, nodes = jobs[0]
    where = {**moment(workdir, name, started), "job": job_name, "nodes": nodes}
    urgent = sbatch(
        f"--partition={URGENT}", f"--nodelist={','.join(nodes)}", f"--nodes={len(nodes)}", "--exclusive",
        "--job-name=chaos-urgent", "--time=5", "--output=/dev/null", "--wrap", f"sleep {URGENT_WAIT_S * 2}",
    )  # fmt: skip
    try:
        asked = time.time()
        while (state := squeue_state(urgent)) not in ("RUNNING", None) and time.time() < asked + URGENT_WAIT_S:
            time.sleep(POLL_S)
        where.update(urgent_state=state, urgent_waited_s=round(time.time() - asked, 1))
        where["job_ended"] = slurm_states.settled_state(job_id)
    finally:
        slurm_states.cancel(urgent)
    return where


def preempt_cancel_train(driver, workdir: Path, name: str, at: float, started: float) -> dict | None:
    return preempt(driver, workdir, name, at, started, training_job)


def preempt_cancel_profile(driver, workdir: Path, name: str, at: float, started: float) -> dict | None:
    return preempt(driver, workdir, name, at, started, profiling_job)


def train_limit_states(name: str) -> list[str]:
    """The ends accounting holds of the run's train jobs, each run of a requeued one too (sacct -D)."""
    out = subprocess.run(
        ["sacct", "-n", "-P", "-X", "-D", f"--name={name}-train", "-o", "State"], capture_output=True, text=True
    ).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def time_limit_requeue_off(driver, workdir: Path, name: str, at: float, started: float) -> dict | None:
    states = wait_until(driver, at, lambda: LIMIT_STATES & set(train_limit_states(name)))
    if states is None:
        return None
    return {**moment(workdir, name, started), "job": f"{name}-train", "train_ends": train_limit_states(name)}


@contextmanager
def nodes_taken(name: str) -> Iterator[list[str]]:
    """Each node of the run's partition asked for by a job of another name (one a node: a QOS may cap a job's
    nodes), from now until the block ends: the run's next job pends behind them (one running now keeps its nodes)."""
    listed = subprocess.run(["sinfo", "-h", "-N", "-p", RUN_PARTITION, "-o", "%N"], capture_output=True, text=True)
    blockers = [
        sbatch(f"--partition={RUN_PARTITION}", f"--nodelist={node}", "--exclusive", f"--job-name=chaos-blocker-{name}",
               "--output=/dev/null", "--wrap", f"sleep {BLOCKER_S}")
        for node in sorted(set(listed.stdout.split()))
    ]  # fmt: skip
    try:
        yield blockers
    finally:
        for blocker in blockers:  # retried while slurmctld is away (restart_slurmctld_pending): it must not stay
            slurm_states.cancel(blocker)


@contextmanager
def job_pending(driver, name: str, at: float) -> Iterator[tuple[str, str] | None]:
    """(job id, job name) of the run's first job to pend once `at` has come (nodes_taken makes it pend), the nodes
    taken while the block runs; None if the run ended first."""
    if wait_until(driver, at) is None:
        yield None
        return
    with nodes_taken(name):
        yield (found := wait_until(driver, at, lambda: our_jobs(name, "PENDING"))) and found[0]


def admin_hold(driver, workdir: Path, name: str, at: float, started: float) -> dict | None:
    with job_pending(driver, name, at) as pending:
        if pending is None:
            return None
        job_id, job_name = pending
        held = subprocess.run(["scontrol", "hold", job_id], capture_output=True, text=True)
    where = {**moment(workdir, name, started), "job": job_name, "job_id": job_id, "held": held.returncode == 0}
    where["held_cancelled"] = ended_cancelled(driver, job_id, HOLD_S)
    released = subprocess.run(["scontrol", "release", job_id], capture_output=True, text=True)
    where["released"] = released.returncode == 0
    return where


def ended_cancelled(driver, job_id: str, seconds: float) -> bool:
    """Whether the held job ended CANCELLED within `seconds` (the run, not the site, cancelled it)."""
    until = time.time() + seconds
    while time.time() < until and driver.poll() is None:
        if slurm_states.slurm_state(job_id) == "CANCELLED":
            return True
        time.sleep(1)
    return slurm_states.slurm_state(job_id) == "CANCELLED"


def restart_slurmctld_pending(driver, workdir: Path, name: str, at: float, started: float) -> dict | None:
    with job_pending(driver, name, at) as pending:
        if pending is None:
            return None
        where = {**moment(workdir, name, started), "job": pending[1]}
        slurmctld_outage(driver)
    return where


def results_since(workdir: Path, name: str, since: float) -> list[Path]:
    """The run's result pickles written at `since` or later (one may be gone between listing and stat)."""
    fresh = []
    for path in (workdir / "work" / name).rglob("*_result.pkl"):
        try:
            if path.stat().st_mtime >= since:
                fresh.append(path)
        except OSError:
            continue
    return fresh


def late_results(driver, workdir: Path, name: str, at: float, started: float) -> dict | None:
    """The first result pickle written after `at`, moved aside as soon as it is seen and put back LAG_S later."""
    fresh = wait_until(driver, at, lambda: results_since(workdir, name, at))
    if fresh is None:
        return None
    path = fresh[0]
    aside = path.with_name(f".{path.name}.lagging")
    try:
        path.rename(aside)
    except FileNotFoundError:  # gone between the look and the move: nothing was hidden
        return None
    where = {**moment(workdir, name, started), "file": str(path.relative_to(workdir))}
    where["hidden_after_s"] = round(time.time() - aside.stat().st_mtime, 2)  # how late the bench itself saw it
    try:
        hold(driver, LAG_S)
    finally:
        aside.rename(path)
    return where


SITE_FAULTS = {
    fault.__name__: fault
    for fault in (
        preempt_cancel_train,
        preempt_cancel_profile,
        time_limit_requeue_off,
        admin_hold,
        restart_slurmctld,
        restart_slurmctld_pending,
        late_results,
    )
}

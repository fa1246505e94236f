"""Why a pending job waits (squeue's reason, Slurm's own names: `man squeue`, JOB REASON CODES) and what follows from
it: a reason that can clear is printed while the job waits; the hold the project's own requeue causes is replaced;
any other hold is waited on; a reason that waiting cannot clear fails the stage, naming what to change."""

from __future__ import annotations

import subprocess

from tula_hpc.cluster.slurm_states import cancel

# The hold a requeue leaves where the requeued job failed to launch (its earlier run's step still ended on a node
# that came back): it waits for an administrator, so the work goes in a new job (SlurmLauncher.again).
REQUEUE_HELD = "launch failed requeued held"
HOLDS = {
    REQUEUE_HELD: "its requeue failed to launch: it is replaced by a new job",
    "JobHeldAdmin": "held by an administrator: it waits until one releases it",
    "JobHeldUser": "held by its user: `scontrol release {job_id}` lets it run",
}
# Reasons no wait clears, and what to change (a limit named *PerJob* is the QOS's or association's, per job)
NEVER_CLEARS = {
    "PartitionNodeLimit": "fewer nodes (search.nodes.max) or another partition (resources.slurm.partition)",
    "PartitionTimeLimit": "a shorter time (resources.time_min, resources.time_limit) or another partition",
    "InvalidQOS": "a QOS your account may use (resources.slurm.qos)",
    "InvalidAccount": "an account you belong to (resources.slurm.account)",
    "BadConstraints": "a constraint some node meets (resources.slurm.constraint)",
    "DependencyNeverSatisfied": "the job it depends on failed: run it again",
    "AccountNotAllowed": "an account the partition allows (resources.slurm.account, resources.slurm.partition)",
    "QOSNotAllowed": "a QOS the partition allows (resources.slurm.qos, resources.slurm.partition)",
}
# A limit of the user's own (per user or account, or the association's total) clears only as the user's other
# jobs end: with none running, it never does
OWN_LIMIT_MARKS = ("PerUser", "PerAccount", "AssocGrp")
# What to ask for less of, by the resource a QOS or association limit names
LIMITED_RESOURCE = (
    ("GRES", "fewer GPUs (resources.gpus_per_node, search.gpus_per_node.max)"),
    ("Node", "fewer nodes (search.nodes.max)"),
    ("Cpu", "fewer cores (resources.cpus_per_task)"),
    ("Mem", "less memory (resources.mem_gb)"),
    ("Wall", "a shorter time (resources.time_min, resources.time_limit)"),
)


class PendingForever(RuntimeError):
    """A job pends on a reason no wait clears; it has been cancelled, and the message says what to change."""


def what_to_change(reason: str) -> str | None:
    """What to change for a reason no wait clears; None for one that can clear (own limits: see OWN_LIMIT_MARKS)."""
    if reason in NEVER_CLEARS:
        return NEVER_CLEARS[reason]
    if "PerJob" in reason or any(mark in reason for mark in OWN_LIMIT_MARKS):
        asked = next((change for word, change in LIMITED_RESOURCE if word in reason), "fewer resources")
        return f"{asked}, or a QOS whose limits allow it (resources.slurm.qos)"
    return None


def pending_reason(job_id: str) -> str | None:
    """squeue's reason for the job (`%r`); None where squeue does not say (the controller away, the job gone)."""
    listed = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%r"], capture_output=True, text=True)
    reason = listed.stdout.strip()
    return reason if listed.returncode == 0 and reason and reason != "None" else None


def other_jobs_run(job_id: str) -> bool:
    """Whether another job of this user runs (and may free a limit of the user's own as it ends). True where
    squeue does not answer: nothing is cancelled on missing information."""
    listed = subprocess.run(["squeue", "-h", "--me", "-t", "RUNNING", "-o", "%i"], capture_output=True, text=True)
    return listed.returncode != 0 or bool(set(listed.stdout.split()) - {job_id})


class PendingWatch:
    """Looks at a pending job's reason on each poll: prints it once, and again when it changes."""

    def __init__(self, job_id: str, name: str):
        self.job_id, self.name, self.reason = job_id, name, None

    def requeue_held(self) -> bool:
        """Whether the job is held by a failed requeue's launch (REQUEUE_HELD): the caller replaces it. Any other
        reason is printed, and one no wait clears cancels the job and raises PendingForever."""
        reason = pending_reason(self.job_id)
        if reason is None:
            return False
        if reason != self.reason:
            self.reason = reason
            why = HOLDS.get(reason, "").format(job_id=self.job_id)
            print(f"[tula-hpc] slurm job {self.job_id} ({self.name}) pends: {reason}{f' ({why})' if why else ''}")
        change = what_to_change(reason)
        own_limit = any(mark in reason for mark in OWN_LIMIT_MARKS) and "PerJob" not in reason
        if change is not None and not (own_limit and other_jobs_run(self.job_id)):
            cancel(self.job_id)
            raise PendingForever(
                f"{self.name}: slurm job {self.job_id} pends on {reason}, which no wait clears"
                f"{' (no other job of yours runs to free it)' if own_limit else ''}; it was cancelled. Ask for {change}"
            )
        return reason == REQUEUE_HELD

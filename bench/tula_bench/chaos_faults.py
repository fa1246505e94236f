"""The faults bench/chaos.py injects, each landing at a moment `at` (epoch seconds) on what of the run exists then,
and returning where it landed (None if the run ended first):
- kill_driver: SIGKILL of Snakemake and its stages (their process group), as a login session that dies;
- kill_rank: SIGKILL of rank 1 of a running job of two ranks (a 2-node profile step or the train job);
- scancel_stage: scancel of a job a stage waits on (the measuring allocation, or the train or evaluate job);
- node_down: a node of a running job of the run set DOWN (scontrol), and resumed DOWN_S later;
- restart_slurmctld: slurmctld stopped (SIGTERM) while a job of the run runs, and started again (up.sh) OUTAGE_S later;
- full_disk: the run's folder (a tmpfs chaos.py made for the trial) filled up for FULL_S, then freed;
- corrupt_checkpoint: the driver killed mid-training, the train job cancelled, its checkpoint truncated to half.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import psutil

from tula_bench.common import REPO
from tula_hpc.cluster import slurm_states
from tula_hpc.training.checkpoint import load_checkpoint, previous_path

POLL_S = 0.2
DOWN_S = 20  # a node down this long: Slurm's jobs on it end, and what was requeued waits for it
OUTAGE_S = 10  # slurmctld away this long: every squeue of the stages fails meanwhile
FULL_S = 15  # the file system full this long
SLURM = REPO / "scripts" / "slurm"
SLURMCTLD_PID = REPO / "work" / "slurm" / "pids" / "slurmctld.pid"


def wait_until(driver: subprocess.Popen, at: float, target=lambda: True):
    """`target()` once the moment `at` (epoch seconds) has come and it is truthy; None if the driver ended first."""
    while driver.poll() is None:
        if time.time() >= at and (found := target()):
            return found
        time.sleep(POLL_S)
    return None


def our_jobs(name: str, state: str = "RUNNING") -> list[tuple[str, str]]:
    """(job id, job name) of the run's jobs in `state` (none while slurmctld is away)."""
    out = subprocess.run(["squeue", "-h", "-t", state, "-o", "%i %j"], capture_output=True, text=True).stdout
    return [tuple(line.split()[:2]) for line in out.splitlines() if line.split()[1].startswith(f"{name}-")]


def job_nodes(job_id: str) -> list[str]:
    nodelist = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%N"], capture_output=True, text=True).stdout
    hosts = subprocess.run(["scontrol", "show", "hostnames", nodelist.strip()], capture_output=True, text=True)
    return hosts.stdout.split()


def rank_pids(name: str, rank: int = 1) -> list[int]:
    """Processes running rank `rank` of one of the run's Slurm jobs (submitit's runner)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            env = dict(kv.split("=", 1) for kv in (proc / "environ").read_text().split("\0") if "=" in kv)
            cmdline = (proc / "cmdline").read_text()
        except (OSError, ValueError):
            continue
        running_ours = env.get("SLURM_JOB_NAME", "").startswith(f"{name}-") and "submitit.core._submit" in cmdline
        if running_ours and env.get("SLURM_PROCID") == str(rank):
            pids.append(int(proc.name))
    return pids


def moment(workdir: Path, name: str, started: float) -> dict:
    """When a fault landed: seconds after the start, the stage whose job record is newest, the checkpoint then."""
    work = workdir / "work" / name
    records = sorted(work.rglob("job.json"), key=lambda p: p.stat().st_mtime)  # profiles: profile/N1_B32/job.json
    stage = str(records[-1].parent.relative_to(work)) if records else None
    where = {"at_s": round(time.time() - started, 1), "stage": stage}
    saved = load_checkpoint(workdir / "work" / name / "train" / "checkpoint.pt")  # the previous one mid-save
    if saved is not None:
        where.update(epoch=saved["state"]["epoch"], step=saved["state"]["step"])
    return where


def kill_driver(driver: subprocess.Popen, workdir: Path, name: str, at: float, started: float) -> dict | None:
    if wait_until(driver, at) is None:
        return None
    where = moment(workdir, name, started)
    os.killpg(driver.pid, signal.SIGKILL)
    return where


def kill_rank(driver: subprocess.Popen, workdir: Path, name: str, at: float, started: float) -> dict | None:
    pids = wait_until(driver, at, lambda: rank_pids(name))
    if pids is None:
        return None
    where = moment(workdir, name, started)
    os.kill(pids[0], signal.SIGKILL)
    return where


def scancel_stage(driver: subprocess.Popen, workdir: Path, name: str, at: float, started: float) -> dict | None:
    jobs = wait_until(driver, at, lambda: our_jobs(name))
    if jobs is None:
        return None
    job_id, job_name = jobs[0]
    where = {**moment(workdir, name, started), "job": job_name}
    subprocess.run(["scancel", job_id], check=True)
    return where


def corrupt_checkpoint(driver: subprocess.Popen, workdir: Path, name: str, at: float, started: float) -> dict | None:
    checkpoint = workdir / "work" / name / "train" / "checkpoint.pt"
    if wait_until(driver, at, checkpoint.exists) is None:
        return None
    os.killpg(driver.pid, signal.SIGKILL)
    driver.wait()
    for job_id, _ in our_jobs(name, "PENDING,RUNNING"):
        subprocess.run(["scancel", job_id], check=True)
        while slurm_states.slurm_state(job_id) in slurm_states.ACTIVE_SLURM_STATES:
            time.sleep(1)
    where = {**moment(workdir, name, started), "older_checkpoint": previous_path(checkpoint).exists()}
    checkpoint.write_bytes(checkpoint.read_bytes()[: checkpoint.stat().st_size // 2])
    return where


def node_down(driver: subprocess.Popen, workdir: Path, name: str, at: float, started: float) -> dict | None:
    """Set DOWN, Slurm ends (and requeues where it may) the jobs on the node; the cluster's ReturnToService=2 would
    take it back as soon as its slurmd answers, so it is drained too until it is resumed DOWN_S later, as a node that
    is away that long."""
    jobs = wait_until(driver, at, lambda: [(i, n, nodes) for i, n in our_jobs(name) if (nodes := job_nodes(i))])
    if jobs is None:
        return None
    _, job_name, nodes = jobs[0]
    where = {**moment(workdir, name, started), "job": job_name, "node": nodes[-1]}
    update = ["scontrol", "update", f"nodename={nodes[-1]}"]
    subprocess.run([*update, "state=down", "reason=chaos bench"], check=True)
    try:
        subprocess.run([*update, "state=drain", "reason=chaos bench"], check=True)
        hold(driver, DOWN_S)
    finally:
        subprocess.run([*update, "state=resume"], check=True)
    return where


def restart_slurmctld(driver: subprocess.Popen, workdir: Path, name: str, at: float, started: float) -> dict | None:
    jobs = wait_until(driver, at, lambda: our_jobs(name))
    if jobs is None:
        return None
    where = {**moment(workdir, name, started), "job": jobs[0][1]}
    slurmctld_outage(driver)
    return where


def slurmctld_outage(driver: subprocess.Popen) -> None:
    """slurmctld stopped (SIGTERM) for OUTAGE_S, then started again by up.sh (under the site profile it ran)."""
    controller = psutil.Process(int(SLURMCTLD_PID.read_text()))
    controller.terminate()
    controller.wait(timeout=60)
    try:
        hold(driver, OUTAGE_S)
    finally:
        subprocess.run(["bash", str(SLURM / "up.sh")], check=True, capture_output=True)


def full_disk(driver: subprocess.Popen, workdir: Path, name: str, at: float, started: float) -> dict | None:
    if wait_until(driver, at) is None:
        return None
    where = moment(workdir, name, started)
    filler = workdir / "chaos-filler"
    with open(filler, "wb", buffering=0) as out:
        for chunk in (1 << 20, 1 << 12):  # MiBs, then what is left of the last one
            try:
                while True:
                    out.write(bytes(chunk))
            except OSError:  # ENOSPC: full
                pass
    where["filled_bytes"] = filler.stat().st_size
    try:
        hold(driver, FULL_S)
    finally:
        filler.unlink()
    return where


def hold(driver: subprocess.Popen, seconds: float) -> None:
    """Let a fault last `seconds`, or until the driver has ended."""
    until = time.time() + seconds
    while time.time() < until and driver.poll() is None:
        time.sleep(POLL_S)


FAULTS = {
    fault.__name__: fault
    for fault in (
        kill_driver,
        kill_rank,
        scancel_stage,
        node_down,
        restart_slurmctld,
        full_disk,
        corrupt_checkpoint,
    )
}

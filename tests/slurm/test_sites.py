"""The local cluster as a real site runs it (site profile `strict`, scripts/slurm/sites/strict.sh): preemption that
cancels after a grace time, requeue off, cores confined by cgroups, QOS limits enforced; and the project on it."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.conftest import REPO, wait_for
from tests.slurm.workers import report_ranks
from tula_hpc.cluster import launch
from tula_hpc.cluster.slurm_states import slurm_state
from tula_hpc.core.atomic_files import read_json

pytestmark = pytest.mark.slurm
GRACE_S = 20  # strict.sh: the debug partition's GraceTime


def _settings(*command: str) -> dict[str, str]:
    """`scontrol show config`'s "Key = value" lines, or a partition's Key=value words."""
    out = subprocess.run(["scontrol", "show", *command], capture_output=True, text=True, check=True).stdout
    if command[0] == "config":
        return {
            key.strip(): value.strip()
            for key, value in (line.split(" = ", 1) for line in out.splitlines() if " = " in line)
        }
    return dict(word.split("=", 1) for word in out.split() if "=" in word)


def _sbatch(*args: str) -> str:
    return subprocess.run(["sbatch", "--parsable", *args], capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture
def cancel_afterwards():
    """Job ids a test adds here are cancelled when it ends, whatever it asserted."""
    job_ids: list[str] = []
    yield job_ids
    if job_ids:
        subprocess.run(["scancel", *job_ids], capture_output=True)


def test_the_strict_settings_hold(strict_site):
    config = _settings("config")
    assert (config["PreemptType"], config["PreemptMode"], config["JobRequeue"]) == (
        "preempt/partition_prio",
        "CANCEL",
        "0",
    )
    assert config["TaskPlugin"] == "task/cgroup,task/affinity" and config["ConstrainCores"] == "yes"
    assert set(config["AccountingStorageEnforce"].split(",")) >= {"associations", "limits", "qos"}
    debug, urgent = _settings("partition", "debug"), _settings("partition", "urgent")
    assert (debug["PreemptMode"], debug["GraceTime"], debug["Default"]) == ("CANCEL", str(GRACE_S), "YES")
    assert (urgent["PreemptMode"], urgent["Nodes"]) == ("OFF", debug["Nodes"])
    assert int(urgent["PriorityTier"]) > int(debug["PriorityTier"])


@pytest.mark.parametrize("cpus", [1, 2])
def test_srun_confines_a_task_to_the_cores_it_asks_for(strict_site, cpus):
    count = "import os; print(len(os.sched_getaffinity(0)))"
    proc = subprocess.run(["srun", "-N1", f"-c{cpus}", "python3", "-c", count], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(cpus)]


def test_a_job_over_its_qos_limit_pends_saying_which(strict_site, cancel_afterwards):
    """QOS `capped` allows one node per job: a 2-node job under it is accepted and waits, for ever, with the reason."""
    job_id = _sbatch("-N2", "--qos=capped", "--wrap", "true")
    cancel_afterwards.append(job_id)

    def reason() -> bool:
        out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T %r"], capture_output=True, text=True).stdout
        return out.split() == ["PENDING", "QOSMaxNodePerJobLimit"]

    wait_for(reason, 30, f"job {job_id} to pend with reason QOSMaxNodePerJobLimit")


def test_an_urgent_job_cancels_a_debug_job_after_the_grace_time(strict_site, cancel_afterwards, tmp_path):
    """The debug job's tasks get SIGTERM at once; one that carries on (submitit's bypasses it) is killed once the
    grace time is over, and the job ends PREEMPTED: never requeued."""
    told = tmp_path / "sigterm"
    task = tmp_path / "task.sh"
    task.write_text(f"#!/bin/bash\ntrap 'date +%s.%N >>{told}' TERM\nwhile :; do sleep 0.2; done\n")
    task.chmod(0o755)
    victim = _sbatch("-p", "debug", "-N2", "--exclusive", "--wrap", f"srun {task}")
    cancel_afterwards.append(victim)
    wait_for(lambda: slurm_state(victim) == "RUNNING", 60, f"debug job {victim} to run")
    asked = time.time()
    urgent = _sbatch("-p", "urgent", "-N1", "-c2", "--wrap", "true")
    cancel_afterwards.append(urgent)
    wait_for(lambda: slurm_state(victim) == "PREEMPTED", 90, f"debug job {victim} to end PREEMPTED")
    assert time.time() - asked >= GRACE_S
    assert float(told.read_text().split()[0]) - asked < GRACE_S / 2, "the tasks must be told at once"
    wait_for(lambda: slurm_state(urgent) == "COMPLETED", 60, f"urgent job {urgent} to complete")


def test_each_rank_gets_the_cpus_per_task_it_asks_for(strict_site, tmp_path):
    """issue 56 defect 1: the batch script's srun must carry -c, or each rank runs on one core."""
    spec = launch.LaunchSpec(launcher="slurm", nodes=2, cpus_per_task=2, mem_gb=2, time_min=5)
    ranks = launch.run(report_ranks, {}, spec, tmp_path, name="site-cpus")
    assert [(r["rank"], r["cpus"]) for r in ranks] == [(0, 2), (1, 2)]


# bench/chaos_sites.py's seed-56 draws under `strict` alone: trial 11 preempts (cancels) the digits job's train job
# early in training. Its undisturbed run is the DAG on a strict site; the trial, that DAG surviving the cancel.
PREEMPTED_TRAINING_TRIAL = 11


def test_the_dag_completes_on_a_strict_site_and_again_after_preemption_cancels_its_training(strict_site, tmp_path):
    """The short variant of bench/chaos_sites.py CI runs (the full 40 trials take longer than CI may)."""
    out = tmp_path / "chaos_sites.json"
    command = [sys.executable, str(REPO / "bench" / "chaos_sites.py"), "--profiles", "strict"]
    command += ["--only", str(PREEMPTED_TRAINING_TRIAL), "--reference-runs", "1", "--out", str(out)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = read_json(out)
    assert [(t["job"], t["fault"]) for t in result["trials"]] == [("digits", "preempt_cancel_train")]
    assert result["trials"][0]["moment"] is not None  # the fault landed: the train job was preempted
    summary = result["summary"]
    assert summary["profiles"] == ["strict"] and summary["completed"] == 1 and summary["manual_steps"] == 0
    assert summary["bad_files_accepted"] == 0 and summary["steps_repeated_beyond_one"] == 0
    assert summary["held_jobs_cancelled"] == 0 and summary["longest_silent_wait_s"] <= 300

"""Benchmark: faults at random moments in the DAG on the local Slurm cluster, each followed by running the same
command again until the DAG completes (issue 28). `make slurm-up` first; run under flock /tmp/tula-cpu.lock.

First an undisturbed run; then each trial runs the same DAG (the default digits job, shortened as in
bench/queue_wait.py) through profiles/slurm in a fresh folder under a fresh job name. A fault kind and a moment
(seconds after the start, uniform over the undisturbed run's length) are drawn from the seed; at that moment the
fault lands on what runs then (a fault whose target does not exist yet waits for it, while the DAG runs). Then the
same command runs again, up to MAX_RERUNS times, until report.md exists. Faults in this version:
- kill_driver: SIGKILL of Snakemake and its stages (their process group), as a login session that dies;
- kill_rank: SIGKILL of rank 1 of a running job of two ranks (a 2-node profile step or the train job);
- scancel_stage: scancel of a job a stage waits on (the measuring allocation, or the train or evaluate job);
- corrupt_checkpoint: the driver killed mid-training, the train job cancelled, its checkpoint truncated to half
  (survivable where an older checkpoint exists; where none does, the user must be told which file and what to do).
Per trial: the fault and its moment (seconds, the stage whose job ran, the checkpoint's epoch and step), whether the
DAG completed and after how many reruns, the wall time lost against the undisturbed run, training's restarts,
whether the final weights equal the undisturbed run's (where both chose the same configuration: a fault during
profiling may change the measurements and so the choice), and the final files that cannot be read. Training steps
computed twice are not counted in this version (null).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import torch
import yaml
from common import bench_config, bench_parser, dag_command, provenance, use_local_cluster, write_and_report

from tula_hpc import slurm_states
from tula_hpc.checkpoint import load_checkpoint, previous_path

DAG_CHANGES = {"train": {"epochs": 12, "lr_milestones": [9]}, "search": {"warmup_steps": 2, "steps": 4}}
MAX_RERUNS = 3
FIRST_S = 5  # no fault before Snakemake has started anything
POLL_S = 0.2


def start(workdir: Path) -> subprocess.Popen:
    """The same command every time: the DAG through profiles/slurm, in its own process group."""
    log = open(workdir / "snakemake.log", "a")  # noqa: SIM115 (the driver's output until it ends)
    return subprocess.Popen(dag_command(workdir, "slurm"), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def new_run(root: Path, tag: str) -> tuple[Path, str]:
    workdir, name = root / tag, f"c{uuid.uuid4().hex[:6]}"
    config = bench_config(as_name=name, **DAG_CHANGES)
    del config["launcher"], config["slurm"]  # the profile's to set, as for any jobs file
    workdir.mkdir(parents=True)
    (workdir / "jobs.yaml").write_text(yaml.safe_dump(config))
    return workdir, name


def finished(workdir: Path, name: str) -> bool:
    return (workdir / "results" / name / "report.md").exists()


def wait_until(driver: subprocess.Popen, at: float, target=lambda: True):
    """`target()` once the moment `at` (epoch seconds) has come and it is truthy; None if the driver ended first."""
    while driver.poll() is None:
        if time.time() >= at and (found := target()):
            return found
        time.sleep(POLL_S)
    return None


def our_jobs(name: str, state: str = "RUNNING") -> list[tuple[str, str]]:
    """(job id, job name) of the run's jobs in `state`."""
    out = subprocess.run(["squeue", "-h", "-t", state, "-o", "%i %j"], capture_output=True, text=True).stdout
    return [tuple(line.split()) for line in out.splitlines() if line.split()[1].startswith(f"{name}-")]


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


FAULTS = {fault.__name__: fault for fault in (kill_driver, kill_rank, scancel_stage, corrupt_checkpoint)}


def unreadable(workdir: Path, name: str) -> list[str]:
    """The run's final files that cannot be read back: a result accepted in a bad state."""
    bad = []
    for path in (workdir / "results" / name).rglob("*.json"):
        try:
            json.loads(path.read_text())
        except (OSError, ValueError):
            bad.append(str(path))
    for path in (workdir / "results" / name).rglob("*.pt"):
        try:
            torch.load(path, map_location="cpu", weights_only=False)
        except Exception:  # whatever a damaged file raises
            bad.append(str(path))
    return bad


def outcome(workdir: Path, name: str) -> dict:
    """What the finished run chose and trained: the configuration, the weights, training's restarts."""
    results = workdir / "results" / name
    chosen = json.loads((results / "selection.json").read_text())["chosen"]
    summary = json.loads((results / "train" / "summary.json").read_text())
    return {
        "chosen": {"nodes": chosen["nodes"], "batch": chosen["batch"]},
        "weights": torch.load(results / "train" / "model.pt", map_location="cpu", weights_only=False)["model"],
        "restarts_at_steps": summary["restarts_at_steps"],
        "resumed_from_epoch": summary.get("resumed_from_epoch"),
    }


def trial(root: Path, index: int, fault: str, share: float, reference: dict) -> dict:
    """Trial `index`: `fault` at `share` of the way from FIRST_S to 90 % of the undisturbed run's length."""
    workdir, name = new_run(root, f"trial{index}")
    at_s = FIRST_S + share * (0.9 * reference["wall_s"] - FIRST_S)
    started = time.time()
    driver = start(workdir)
    where = FAULTS[fault](driver, workdir, name, started + at_s, started)
    driver.wait()
    reruns = 0
    while not finished(workdir, name) and reruns < MAX_RERUNS:
        reruns += 1
        start(workdir).wait()
    record = {"index": index, "fault": fault, "drawn_share": share, "moment": where, "job": name}
    record.update(completed=finished(workdir, name), reruns=reruns, wall_s=round(time.time() - started, 1))
    record["wall_lost_s"] = round(record["wall_s"] - reference["wall_s"], 1)
    if not record["completed"]:  # what the user is told: the train log names the damaged files and what to do
        log = workdir / "logs" / name / "train.log"
        record["told_what_to_do"] = log.exists() and "no checkpoint of this run can be read" in log.read_text()
    if record["completed"]:
        done = outcome(workdir, name)
        same = done["chosen"] == reference["chosen"]
        weights = reference["weights"]
        equal = same and all(torch.equal(done["weights"][k], weights[k]) for k in weights)
        record.update(
            chosen=done["chosen"],
            same_choice=same,
            bit_equal=bool(equal),
            restarts_at_steps=done["restarts_at_steps"],
            resumed=bool(done["restarts_at_steps"]) or done["resumed_from_epoch"] is not None,
            unreadable_files=unreadable(workdir, name),
        )
    return record


def undisturbed(root: Path) -> dict:
    workdir, name = new_run(root, "undisturbed")
    started = time.time()
    if start(workdir).wait() != 0 or not finished(workdir, name):
        raise SystemExit(f"the undisturbed run failed; read {workdir / 'snakemake.log'}")
    return {"wall_s": time.time() - started, **outcome(workdir, name)}


def summarise(trials: list[dict], seed: int) -> dict:
    resumed = [t for t in trials if t.get("resumed") and t.get("same_choice")]
    return {
        "trials": len(trials),
        "completed": sum(t["completed"] for t in trials),
        "manual_steps": sum(not t["completed"] for t in trials),  # not done by the same command, MAX_RERUNS times
        "bad_files_accepted": sum(len(t.get("unreadable_files", [])) for t in trials),
        "steps_repeated_beyond_one": None,
        "bit_equal_share": sum(t["bit_equal"] for t in resumed) / len(resumed) if resumed else None,
        "seed": seed,
    }


def draws(seed: int, trials: int) -> list[tuple[str, float]]:
    """Each trial's fault and moment (its share of the run), from the seed alone: a trial replays by its index."""
    rng = random.Random(seed)
    return [(rng.choice(sorted(FAULTS)), rng.random()) for _ in range(trials)]


def report(result: dict) -> None:
    for t in result["trials"]:
        print(
            f"{t['index']:3d} {t['fault']:18s} {json.dumps(t['moment'])}: "
            + (f"completed after {t['reruns']} rerun(s)" if t["completed"] else "NOT completed")
            + (f", bit-equal {t['bit_equal']}" if t["completed"] else "")
        )
    print(result["summary"])


def main() -> int:
    parser = bench_parser(__doc__, "chaos.json")
    parser.add_argument("--trials", type=int, default=40)
    parser.add_argument("--seed", type=int, default=28)
    parser.add_argument("--only", type=int, nargs="+", help="replay these trials of the seed's draws alone")
    args = parser.parse_args()
    use_local_cluster()
    drawn = draws(args.seed, args.trials)
    chosen = args.only if args.only is not None else range(args.trials)
    with tempfile.TemporaryDirectory() as tmp:
        reference = undisturbed(Path(tmp))
        trials = [trial(Path(tmp), i, *drawn[i], reference) for i in chosen]
    result = {
        "summary": summarise(trials, args.seed),
        "targets": {
            "manual_steps": "0",
            "bad_files_accepted": "0",
            "steps_repeated_beyond_one": "0",
            "bit_equal_share": "1",
        },
        "trials": trials,
        "undisturbed": {"wall_s": reference["wall_s"], "chosen": reference["chosen"]},
        "provenance": provenance(),
        "settings": {
            "dag_changes": DAG_CHANGES,
            "faults": sorted(FAULTS),
            "max_reruns": MAX_RERUNS,
            "trials": args.trials,
            "only": args.only,
        },
    }
    return write_and_report(args.out, result, report)


if __name__ == "__main__":
    raise SystemExit(main())

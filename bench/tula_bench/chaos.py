"""Benchmark: faults at random moments in the DAG on the local Slurm cluster, each followed by running the same
command again until the DAG completes (issue 28). `make slurm-up` first; run as root (it takes nodes down, restarts
slurmctld and mounts a small file system) under flock /tmp/tula-cpu.lock.

Two jobs: the default digits job, shortened as in bench/queue_wait.py, and a Fashion-MNIST job whose epochs are long
enough for a fault to land mid-epoch (a share FASHION_MNIST_SHARE of the trials); both checkpoint every step
(resources.checkpoint_every_steps: 1), as a user who cannot afford to compute a step twice would. Each is run
undisturbed REFERENCE_RUNS times first (its wall time the median; two runs that chose alike must end bit-equal, or
no trial's weights could be). Each trial then runs the drawn job through profiles/slurm in a fresh folder under a
fresh job name. The job, the fault and its moment (a share of the span in which the fault's target existed in the
undisturbed run, counted from the target's first appearance in the trial: TARGETS) are drawn from the seed; at
that moment the fault lands on what runs then (a fault whose target is gone by then waits for it to come again,
while the DAG runs). Then the same command runs again, up to MAX_RERUNS times, until report.md exists. The faults
(bench/chaos_faults.py): kill_driver, kill_rank, scancel_stage, node_down, restart_slurmctld, full_disk (the run's
folder a tmpfs of TMPFS_SIZE) and corrupt_checkpoint (survivable where an older checkpoint exists; where none does,
the user must be told which file and what to do).
Per trial: the fault and its moment (seconds, the stage whose job ran, the checkpoint's epoch and step), whether the
DAG completed and after how many reruns, the wall time lost against the undisturbed run, training's restarts and
the steps it computed twice (rank 0 traces each step it runs: loop_accounting.StepTrace), whether the final
weights equal the undisturbed run's (where both chose the same configuration: a fault during profiling may change
the measurements and so the choice), and the final files that cannot be read. After each trial `make slurm-down` and
`make slurm-up` run: no daemon may outlive the first, and the second must work at once. The result file is written
after every trial, so a bench stopped early keeps the trials it ran.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import statistics
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

from tula_bench.chaos_cluster import slurm_cycle
from tula_bench.chaos_faults import DOWN_S, FAULTS, FULL_S, OUTAGE_S, POLL_S, our_jobs, rank_pids, wait_until
from tula_bench.common import (
    bench_config,
    bench_parser,
    dag_command,
    merged,
    provenance,
    use_local_cluster,
    write_and_report,
)
from tula_bench.log_silence import growth_times, longest_silence
from tula_hpc.core.atomic_files import write_json
from tula_hpc.training.loop_accounting import STEP_TRACE_ENV

SEARCH = {"warmup_steps": 2, "steps": 4}
RESOURCES = {"checkpoint_every_steps": 1}  # a SIGKILL then costs only the step it interrupts
JOBS = {
    "digits": {"train": {"epochs": 12, "lr_milestones": [9]}, "search": SEARCH, "resources": RESOURCES},
    "fashion_mnist": {
        "data": {"name": "fashion_mnist", "root": None, "image_size": 14},
        "train": {"epochs": 2, "lr_milestones": [1]},
        "search": SEARCH,
        "resources": RESOURCES,
    },
}
FASHION_MNIST_SHARE = 0.2
REFERENCE_RUNS = 2
MAX_RERUNS = 3
RUN_LIMIT_S = 600  # a run of the DAG still going after this is stuck (an undisturbed one takes 1.5-3 minutes)
FIRST_S = 5  # no fault before Snakemake has started anything
TMPFS_SIZE = "256m"


@dataclass(frozen=True)
class Bench:
    """What a fault bench draws its trials from: its jobs, its faults with their targets (TARGETS), and the changes
    a fault makes to the trial's jobs file (a time limit too short, say). This bench's is CHAOS; chaos_sites.py has
    its own and runs its trials with this module's machinery."""

    jobs: dict
    faults: dict
    targets: dict
    job_changes: dict = field(default_factory=dict)


def start(workdir: Path) -> subprocess.Popen:
    """The same command every time: the DAG through profiles/slurm, in its own process group. Its output and rank
    0's step trace go beside the run's folder, whose file system a fault may fill."""
    log = open(log_path(workdir), "a")  # noqa: SIM115 (the driver's output until it ends)
    env = {**os.environ, STEP_TRACE_ENV: str(trace_path(workdir))}
    return subprocess.Popen(
        dag_command(workdir, "slurm"), stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env
    )


def log_path(workdir: Path) -> Path:
    return workdir.with_name(f"{workdir.name}.snakemake.log")


def trace_path(workdir: Path) -> Path:
    return workdir.with_name(f"{workdir.name}.steps")


def run_log_bytes(workdir: Path, name: str) -> int:
    """What the run has said so far: the driver's output and its stages' logs (where a stage says why it waits)."""
    logs = [log_path(workdir), *(workdir / "logs" / name).glob("*.log")]
    return sum(path.stat().st_size for path in logs if path.exists())


def new_run(root: Path, tag: str, sections: dict, own_file_system: bool = False) -> tuple[Path, str]:
    """A fresh folder (a tmpfs of its own where a fault fills it) holding a jobs file of the job `sections` make
    (bench_config) under a fresh name."""
    workdir, name = root / tag, f"c{uuid.uuid4().hex[:6]}"
    config = bench_config(as_name=name, **sections)
    del config["launcher"], config["slurm"]  # the profile's to set, as for any jobs file
    workdir.mkdir(parents=True)
    if own_file_system:
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE}", "tmpfs", str(workdir)], check=True)
    (workdir / "jobs.yaml").write_text(yaml.safe_dump(config))
    return workdir, name


def finished(workdir: Path, name: str) -> bool:
    return (workdir / "results" / name / "report.md").exists()


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
    """What the finished run chose and trained: the configuration, the weights, training's restarts, and how far
    the measured training time was from the predicted one (the evaluate stage's time_rel_error)."""
    results = workdir / "results" / name
    chosen = json.loads((results / "selection.json").read_text())["chosen"]
    summary = json.loads((results / "train" / "summary.json").read_text())
    return {
        "chosen": {"nodes": chosen["nodes"], "batch": chosen["batch"]},
        "time_rel_error": json.loads((results / "eval.json").read_text())["time_rel_error"],
        "weights": torch.load(results / "train" / "model.pt", map_location="cpu", weights_only=False)["model"],
        "restarts_at_steps": summary["restarts_at_steps"],
        "resumed_from_epoch": summary.get("resumed_from_epoch"),
    }


def trial(root: Path, index: int, job: str, fault: str, share: float, reference: dict, bench: Bench) -> dict:
    """Trial `index` of `bench`: `fault` at `share` of the way through its target's span (TARGETS); then whatever
    of it is left (the run's jobs, its file system) is taken away."""
    own_file_system = fault == "full_disk"
    sections = merged(bench.jobs[job], bench.job_changes.get(fault, {}))
    workdir, name = new_run(root, f"trial{index}", sections, own_file_system)
    try:
        return run_trial(workdir, name, (index, job, fault, share), reference, bench)
    finally:
        for job_id, _ in our_jobs(name, "PENDING,RUNNING,REQUEUED,COMPLETING"):
            subprocess.run(["scancel", job_id], check=False)
        if own_file_system:
            subprocess.run(["umount", "--lazy", str(workdir)], check=True)


def run_trial(workdir: Path, name: str, drawn: tuple, reference: dict, bench: Bench) -> dict:
    """The drawn trial (index, job, fault, share) in `workdir`; also the longest the run's logs were silent after
    the fault landed (issue 56: a stage waits no more than 5 minutes past a fault without ending or saying why)."""
    index, job, fault, share = drawn
    first_s, last_s = reference["windows_s"].get(fault, (0.0, reference["wall_s"]))
    started = time.time()
    with growth_times(lambda: run_log_bytes(workdir, name), POLL_S) as grew:
        driver = start(workdir)
        where = None
        if wait_until(driver, started + FIRST_S, lambda: bench.targets[fault](workdir, name)) is not None:
            at = time.time() + share * SPAN_SHARE * (last_s - first_s)
            where = bench.faults[fault](driver, workdir, name, at, started)
        stuck = not ended(driver)
        reruns, failed = 0, [failures(workdir, since=0)]
        while not finished(workdir, name) and reruns < MAX_RERUNS:
            reruns, since = reruns + 1, log_path(workdir).stat().st_size
            stuck += not ended(start(workdir))
            failed.append(failures(workdir, since))
    record = {"index": index, "job": job, "fault": fault, "drawn_share": share, "moment": where, "name": name}
    record.update(completed=finished(workdir, name), reruns=reruns, stuck_runs=int(stuck), failed_rules=failed)
    record["silent_wait_s"] = longest_silence(grew, started + where["at_s"], time.time()) if where else None
    record["wall_s"] = round(time.time() - started, 1)
    record["wall_lost_s"] = round(record["wall_s"] - reference["wall_s"], 1)
    record["steps_repeated"] = steps_repeated(workdir)
    if not record["completed"]:  # what the user is told: the train log names the damaged files and what to do
        log = workdir / "logs" / name / "train.log"
        record["told_what_to_do"] = log.exists() and "no checkpoint of this run can be read" in log.read_text()
    if record["completed"]:
        done = outcome(workdir, name)
        same = done["chosen"] == reference["chosen"]
        record.update(
            chosen=done["chosen"],
            same_choice=same,
            bit_equal=same and same_weights(done["weights"], reference["weights"]),
            restarts_at_steps=done["restarts_at_steps"],
            resumed=bool(done["restarts_at_steps"]) or done["resumed_from_epoch"] is not None,
            unreadable_files=unreadable(workdir, name),
        )
    return record


def failures(workdir: Path, since: int) -> list[str]:
    """The rules a run failed (its part of the driver's log starts at byte `since`), each with its log's last line:
    why the command ran again. A killed driver failed none."""
    text = log_path(workdir).read_bytes()[since:].decode(errors="replace")
    found = []
    for rule, block in re.findall(r"Error in rule (\w+):\n((?:[ \t]+.*\n)*)", text):
        log = re.search(r"log: (\S+)", block)
        path = workdir / log.group(1) if log else None
        lines = path.read_text(errors="replace").strip().splitlines() if path and path.is_file() else []
        found.append(f"{rule}: {lines[-1] if lines else '(no log)'}")
    return found


def ended(driver: subprocess.Popen) -> bool:
    """Whether the run ended by itself within RUN_LIMIT_S; a run that did not is stuck (a job waiting for nodes
    that something holds, say) and is killed, as a user would give up on it."""
    try:
        driver.wait(timeout=RUN_LIMIT_S)
        return True
    except subprocess.TimeoutExpired:
        os.killpg(driver.pid, signal.SIGKILL)
        driver.wait()
        return False


def same_weights(ours: dict, theirs: dict) -> bool:
    return ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs)


def steps_repeated(workdir: Path) -> int | None:
    """Training steps rank 0 ran more than once (the trace holds each step it finished; a step a kill interrupted is
    not in it); None where training never started."""
    path = trace_path(workdir)
    if not path.exists():
        return None
    steps = [int(line) for line in path.read_text().split() if line.isdigit()]
    return len(steps) - len(set(steps))


def undisturbed(root: Path, job: str, runs: int, bench: Bench) -> dict:
    """`runs` undisturbed runs of `job`: the median wall time, the first run's choice and weights, and whether every
    run that chose alike ended bit-equal (without which no trial's weights could)."""
    walls, done, windows = [], [], []
    for run in range(runs):
        workdir, name = new_run(root, f"undisturbed-{job}-{run}", bench.jobs[job])
        started, driver = time.time(), start(workdir)
        windows.append(targets_seen(driver, workdir, name, bench.targets))
        if driver.wait() != 0 or not finished(workdir, name):
            raise SystemExit(f"the undisturbed run failed; read {log_path(workdir)}")
        walls.append(time.time() - started)
        done.append({**outcome(workdir, name), "steps_repeated": steps_repeated(workdir)})
    first = done[0]
    alike = [d for d in done[1:] if d["chosen"] == first["chosen"]]
    return {
        "wall_s": statistics.median(walls),
        "walls_s": [round(w, 1) for w in walls],
        "chosen": first["chosen"],
        "choices": [d["chosen"] for d in done],
        "weights": first["weights"],
        "runs_bit_equal": all(same_weights(d["weights"], first["weights"]) for d in alike) if alike else None,
        "steps_repeated": [d["steps_repeated"] for d in done],
        "time_rel_errors": [d["time_rel_error"] for d in done],  # a profile's prediction of training, undisturbed
        "windows_s": windows[walls.index(min(walls))],  # the faster run: a cold first run is slower
    }


def targets_seen(driver: subprocess.Popen, workdir: Path, name: str, targets: dict) -> dict[str, list[float]]:
    """From when to when (seconds after the start) each fault's target existed in this run."""
    started, seen = time.time(), {fault: [] for fault in targets}
    while driver.poll() is None:
        at = round(time.time() - started, 1)
        for fault, target in targets.items():
            if target(workdir, name):
                seen[fault].append(at)
        time.sleep(POLL_S)
    return {fault: [min(times), max(times)] for fault, times in seen.items() if times}


def training_runs(workdir: Path, name: str) -> bool:
    """A checkpoint is worth damaging while training runs: it exists, and training's summary does not yet."""
    train = workdir / "work" / name / "train"
    return (train / "checkpoint.pt").exists() and not (workdir / "results" / name / "train" / "summary.json").exists()


def some_job(workdir: Path, name: str) -> bool:
    return bool(our_jobs(name))


def two_ranks(workdir: Path, name: str) -> bool:
    return bool(rank_pids(name))


# What each fault needs to exist before it can land. A trial's moment is measured from its target's first
# appearance in the trial, over SPAN_SHARE of the time the target lasted in the undisturbed run: a fault lands
# however much faster or slower the trial runs (a rank of two lives only in 2-node profiles and in training).
TARGETS = {
    "kill_driver": lambda workdir, name: True,
    "full_disk": lambda workdir, name: True,
    "scancel_stage": some_job,
    "node_down": some_job,
    "restart_slurmctld": some_job,
    "kill_rank": two_ranks,
    "corrupt_checkpoint": training_runs,
}
SPAN_SHARE = 0.8
CHAOS = Bench(JOBS, FAULTS, TARGETS)


def summarise(trials: list[dict], seed: int) -> dict:
    """The issue's seven figures. A trial may compute once more the step a fault interrupted (killed while its
    checkpoint was written, or whose checkpoint was corrupted); what it computes twice beyond that one is lost work."""
    resumed = [t for t in trials if t.get("resumed") and t.get("same_choice")]
    repeated = [t["steps_repeated"] for t in trials if t.get("steps_repeated") is not None]
    return {
        "trials": len(trials),
        "completed": sum(t["completed"] for t in trials),
        "manual_steps": sum(not t["completed"] for t in trials),  # not done by the same command, MAX_RERUNS times
        "bad_files_accepted": sum(len(t.get("unreadable_files", [])) for t in trials),
        "steps_repeated_beyond_one": sum(max(r - 1, 0) for r in repeated) if repeated else None,
        "bit_equal_share": sum(t["bit_equal"] for t in resumed) / len(resumed) if resumed else None,
        "seed": seed,
    }


def details(trials: list[dict]) -> dict:
    """What else the trials show: faults that never met their target, runs given up on, every step computed twice,
    clean slurm-down/up cycles, and each fault kind's own counts."""
    return {
        "faults_landed": sum(t["moment"] is not None for t in trials),  # the others' target never came
        "stuck_runs": sum(t.get("stuck_runs", 0) for t in trials),
        "steps_repeated": sum(t.get("steps_repeated") or 0 for t in trials),
        "slurm_cycles_clean": sum(not t["slurm_cycle"]["alive_after_down"] for t in trials if "slurm_cycle" in t),
        "by_fault": {
            fault: {
                "trials": len(of := [t for t in trials if t["fault"] == fault]),
                "landed": sum(t["moment"] is not None for t in of),
                "completed": sum(t["completed"] for t in of),
                "steps_repeated": sum(t.get("steps_repeated") or 0 for t in of),
                "bit_equal_of_same_choice": [
                    sum(t.get("bit_equal", False) for t in of),
                    sum(bool(t.get("same_choice")) for t in of),
                ],
            }
            for fault in sorted({t["fault"] for t in trials})
        },
    }


def draws(seed: int, trials: int) -> list[tuple[str, str, float]]:
    """Each trial's job, fault and moment (its share of the run), from the seed alone: a trial replays by its index.
    Faults come in rounds, each a shuffle of every kind, so that every kind gets its share of the trials."""
    rng, drawn = random.Random(seed), []
    while len(drawn) < trials:
        kinds = sorted(FAULTS)
        rng.shuffle(kinds)
        for fault in kinds:
            drawn.append(("fashion_mnist" if rng.random() < FASHION_MNIST_SHARE else "digits", fault, rng.random()))
    return drawn[:trials]


def report(result: dict) -> None:
    for t in result["trials"]:
        print(
            f"{t['index']:3d} {t['job']:13s} {t['fault']:18s} {json.dumps(t['moment'])}: "
            + (f"completed after {t['reruns']} rerun(s)" if t["completed"] else "NOT completed")
            + (f", bit-equal {t['bit_equal']}" if t["completed"] else "")
            + f", steps repeated {t['steps_repeated']}"
        )
    print(json.dumps(result["summary"], indent=1))
    print(json.dumps({k: v for k, v in result["details"].items() if k != "by_fault"}))


def main() -> int:
    parser = bench_parser(__doc__, "chaos.json")
    parser.add_argument("--trials", type=int, default=40)
    parser.add_argument("--seed", type=int, default=28)
    parser.add_argument("--only", type=int, nargs="+", help="replay these trials of the seed's draws alone")
    parser.add_argument("--reference-runs", type=int, default=REFERENCE_RUNS)
    args = parser.parse_args()
    use_local_cluster()
    drawn = draws(args.seed, args.trials)
    chosen = args.only if args.only is not None else range(args.trials)
    settings = {
        "jobs": JOBS,
        "fashion_mnist_share": FASHION_MNIST_SHARE,
        "faults": sorted(FAULTS),
        "max_reruns": MAX_RERUNS,
        "span_share": SPAN_SHARE,
        "first_s": FIRST_S,
        "run_limit_s": RUN_LIMIT_S,
        "down_s": DOWN_S,
        "outage_s": OUTAGE_S,
        "full_s": FULL_S,
        "tmpfs_size": TMPFS_SIZE,
        "trials": args.trials,
        "only": args.only,
        "reference_runs": args.reference_runs,
    }
    trials, references = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for index in chosen:
            job, fault, share = drawn[index]
            if job not in references:
                references[job] = undisturbed(Path(tmp), job, args.reference_runs, CHAOS)
            trials.append(trial(Path(tmp), index, job, fault, share, references[job], CHAOS))
            trials[-1]["slurm_cycle"] = slurm_cycle()
            write_json(args.out, assemble(trials, references, args.seed, settings))  # kept should the bench stop
    return write_and_report(args.out, assemble(trials, references, args.seed, settings), report)


def assemble(trials: list[dict], references: dict, seed: int, settings: dict) -> dict:
    return {
        "summary": summarise(trials, seed),
        "details": details(trials),
        "targets": {
            "manual_steps": "0",
            "bad_files_accepted": "0",
            "steps_repeated_beyond_one": "0",
            "bit_equal_share": "1",
            "slurm_cycles_clean": "every trial",
        },
        "trials": trials,
        "undisturbed": {job: {k: v for k, v in ref.items() if k != "weights"} for job, ref in references.items()},
        "provenance": provenance(),
        "settings": settings,
    }

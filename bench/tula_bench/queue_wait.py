"""Benchmark: the measuring phase in one allocation, the wall time from the prediction, and the queue in view, on
the local Slurm cluster under a competing load (issue 27). `make slurm-up` first; run under flock
/tmp/tula-cpu.lock.

Load: the bench submits a stream of competing jobs (name `competing-load`), each holding both nodes whole
(--exclusive) for LOAD_S seconds, the next one as soon as the last has ended; Slurm serves pending jobs in
submission order (priority/basic), so a job of ours submitted while one of them runs waits for it, and the next
competing job waits for ours. The bench stops the stream and cancels its jobs at the end.

Runs, each the default digits DAG (shortened as bench/slurm_overhead.py does) through profiles/slurm under a fresh job
name, one after another under the same load:
- per_stage: resources.allocation per_stage (an sbatch job per probe and profile), time_limit fixed (time_min);
- shared: allocation shared (one allocation for the measuring phase, each measurement a job step in it);
- shared_predicted: shared, and the train job asks for its predicted wall time (time_limit predicted);
- shared_queue: shared, predicted, and objective.queue estimate (each candidate's start from sbatch --test-only).
- per_stage_adaptive, shared_adaptive: per_stage and shared with search.mode adaptive, which adds one profile after
  another (per stage, each a job that waits in the queue).
Per run: wall time to selection.json and to summary.json (from the run's start), the run's Slurm jobs and how many of
them waited in the queue (sacct Submit to Start over WAITED_S), those of the measuring phase, the shared
allocation's node-seconds and the share of them no step used (idle), and the train job's time limit.

Summary: measuring_queue_waits_per_job (shared run), summary_wall_ratio_shared_over_per_stage,
idle_node_seconds_share (shared run), queue_choice_test_passed (tests/slurm/test_queue.py's constructed case, run
here by pytest on the same cluster).
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from datetime import datetime
from pathlib import Path

import yaml

from tula_bench.common import (
    REPO,
    bench_config,
    bench_parser,
    dag_command,
    parse_bench_args,
    provenance,
    use_local_cluster,
    write_and_report,
)
from tula_hpc.cluster import slurm_states

LOAD_S = 40  # each competing job's hold on both nodes
WAITED_S = 5  # a job that started this long after its submission waited in the queue
DAG_CHANGES = {"train": {"epochs": 12, "lr_milestones": [9]}, "search": {"warmup_steps": 2, "steps": 4}}
ADAPTIVE = {**DAG_CHANGES["search"], "mode": "adaptive"}
RUNS = {
    "per_stage": {"resources": {"allocation": "per_stage", "time_limit": "fixed"}},
    "shared": {"resources": {"allocation": "shared", "time_limit": "fixed"}},
    "shared_predicted": {"resources": {"allocation": "shared", "time_limit": "predicted"}},
    "shared_queue": {
        "resources": {"allocation": "shared", "time_limit": "predicted"},
        "objective": {"queue": "estimate"},
    },
    # adaptive search profiles one candidate after another: each a job of its own per stage
    "per_stage_adaptive": {"resources": {"allocation": "per_stage", "time_limit": "fixed"}, "search": ADAPTIVE},
    "shared_adaptive": {"resources": {"allocation": "shared", "time_limit": "fixed"}, "search": ADAPTIVE},
}
MEASURING = ("-probe-memory", "-profile-", "-allocation")
# --smoke, CI's check that the bench runs end to end: the shared run alone, of the smallest DAG, under holds of a few
# seconds, and no second pytest for the queue's constructed case (the suite runs tests/slurm/test_queue.py itself).
SMOKE = {
    "load_s": 5,
    "dag_changes": {"train": {"epochs": 2, "lr_milestones": []}, "search": {"warmup_steps": 1, "steps": 2}},
    "runs": ("shared",),
}


class CompetingLoad(threading.Thread):
    """Jobs of another user's kind holding both nodes LOAD_S seconds each, one after another, until `stop`."""

    def __init__(self, hold_s: int = LOAD_S) -> None:
        super().__init__(daemon=True)
        self.halt, self.jobs, self.hold_s = threading.Event(), [], hold_s

    def run(self) -> None:
        while not self.halt.is_set():
            cmd = ["sbatch", "--parsable", "--job-name=competing-load", "--nodes=2", "--exclusive", "--mem=0"]
            done = subprocess.run(cmd + ["--time=2", "--wrap", f"sleep {self.hold_s}"], capture_output=True, text=True)
            self.jobs.append(done.stdout.strip())
            while (
                not self.halt.is_set() and slurm_states.slurm_state(self.jobs[-1]) in slurm_states.ACTIVE_SLURM_STATES
            ):
                time.sleep(1)

    def stop(self) -> None:
        self.halt.set()
        self.join()
        subprocess.run(["scancel", "--name=competing-load"], check=False)


def _stamp(text: str) -> float | None:
    return None if text in ("", "Unknown", "None") else datetime.fromisoformat(text).timestamp()


def sacct_rows(job_ids: str | None = None, names: str | None = None) -> list[dict]:
    """sacct's rows (allocations and steps) with times as epoch seconds."""
    cmd = ["sacct", "-n", "-P", "-S", "2020-01-01", "-o", "JobID,JobName,NNodes,Submit,Start,End,Timelimit"]
    cmd += ["-j", job_ids] if job_ids else ["-X", "--name", names]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    keys = ("job_id", "name", "nodes", "submit", "start", "end", "time_limit")
    rows = [dict(zip(keys, line.split("|"))) for line in out.splitlines() if line]
    for row in rows:
        row.update(nodes=int(row["nodes"]), **{k: _stamp(row[k]) for k in ("submit", "start", "end")})
    return rows


def our_jobs(name: str) -> list[dict]:
    """The run's own allocations (its job names start with the job's name)."""
    out = subprocess.run(
        ["sacct", "-n", "-X", "-P", "-S", "2020-01-01", "-o", "JobName"], capture_output=True, text=True, check=True
    ).stdout
    names = sorted({line for line in out.splitlines() if line.startswith(f"{name}-")})
    return [row for job_name in names for row in sacct_rows(names=job_name)]


def idle_share(holder: dict) -> dict:
    """The shared allocation's node-seconds, and the share of them in which no step ran."""
    rows = sacct_rows(job_ids=holder["job_id"])
    steps = [r for r in rows if re.fullmatch(r"\d+\.\d+", r["job_id"]) and r["start"] and r["end"]]
    held = holder["nodes"] * (holder["end"] - holder["start"])
    used = sum(s["nodes"] * (s["end"] - s["start"]) for s in steps)
    return {"node_seconds": held, "step_node_seconds": used, "idle_share": 1 - used / held if held else None}


def run_dag(workdir: Path, changes: dict, dag_changes: dict = DAG_CHANGES) -> dict:
    """One DAG run under a fresh job name: the wall times to selection.json and to summary.json, its jobs."""
    name = f"q{uuid.uuid4().hex[:6]}"
    config = bench_config(as_name=name, **{**dag_changes, **changes})
    del config["launcher"], config["slurm"]  # the profile's to set, as for any jobs file
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "jobs.yaml").write_text(yaml.safe_dump(config))
    results = workdir / "results" / name
    cmd = dag_command(workdir, "slurm")
    started, to_selection = time.time(), None
    with open(workdir / "snakemake.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            if to_selection is None and (results / "selection.json").exists():
                to_selection = time.time() - started
            time.sleep(0.5)
    to_summary = time.time() - started
    if proc.returncode != 0:
        raise SystemExit(f"the DAG failed; read {workdir / 'snakemake.log'}")
    time.sleep(slurm_states.ACCOUNTING_LAG_S)
    jobs = our_jobs(name)
    waited = [j for j in jobs if j["start"] - j["submit"] > WAITED_S]
    measuring = [j for j in waited if any(tag in j["name"] for tag in MEASURING)]
    holders = [j for j in jobs if j["name"].endswith("-allocation")]
    train = [j for j in jobs if j["name"].endswith("-train")]
    return {
        "job": name,
        "wall_to_selection_s": to_selection,
        "wall_to_summary_s": to_summary,
        "slurm_jobs": len(jobs),
        "queue_waits": len(waited),
        "measuring_queue_waits": len(measuring),
        "queue_wait_s": sum(j["start"] - j["submit"] for j in waited),
        "allocation": idle_share(holders[0]) if holders else None,
        "train_time_limit": train[-1]["time_limit"] if train else None,
        "jobs": jobs,
    }


def queue_choice_test() -> bool:
    """tests/slurm/test_queue.py's constructed case on this cluster."""
    test = "tests/slurm/test_queue.py::test_a_later_start_is_passed_over_exactly_when_its_wait_outweighs_its_saving"
    return subprocess.run([sys.executable, "-m", "pytest", "-q", test], cwd=REPO).returncode == 0


def report(result: dict) -> None:
    for name, run in result["runs"].items():
        held = run["allocation"]
        print(
            f"{name:17s} to selection {run['wall_to_selection_s']:6.1f} s, "
            f"to summary {run['wall_to_summary_s']:6.1f} s; {run['queue_waits']} of {run['slurm_jobs']} jobs "
            f"waited ({run['measuring_queue_waits']} measuring)"
            + (f"; allocation idle {held['idle_share']:.0%}" if held else "")
        )
    print(result["summary"])


def ratio(runs: dict, over: str, under: str) -> float | None:
    """A wall-time ratio of two runs, None where the smoke run made only one of them."""
    if over not in runs or under not in runs:
        return None
    return runs[over]["wall_to_summary_s"] / runs[under]["wall_to_summary_s"]


def figures(runs: dict, choice_passed: bool | None) -> dict:
    shared, adaptive = runs["shared"], runs.get("shared_adaptive", {})
    return {
        "summary": {
            "measuring_queue_waits_per_job": shared["measuring_queue_waits"],
            "summary_wall_ratio_shared_over_per_stage": ratio(runs, "shared", "per_stage"),
            "idle_node_seconds_share": shared["allocation"]["idle_share"] if shared["allocation"] else None,
            "queue_choice_test_passed": choice_passed,
        },
        "adaptive_search": {
            "summary_wall_ratio_shared_over_per_stage": ratio(runs, "shared_adaptive", "per_stage_adaptive"),
            "measuring_queue_waits_per_stage": runs.get("per_stage_adaptive", {}).get("measuring_queue_waits"),
            "measuring_queue_waits_shared": adaptive.get("measuring_queue_waits"),
            "idle_node_seconds_share": (adaptive.get("allocation") or {}).get("idle_share"),
        },
        "targets": {
            "measuring_queue_waits_per_job": "1",
            "summary_wall_ratio_shared_over_per_stage": "<= 0.6",
            "idle_node_seconds_share": "<= 0.15",
            "queue_choice_test_passed": "true",
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, "queue_wait.json")
    parser.add_argument("--smoke", action="store_true", help="SMOKE: the shared run alone, small (CI's check)")
    args = parse_bench_args(parser, argv)
    use_local_cluster()
    hold_s, dag_changes = (SMOKE["load_s"], SMOKE["dag_changes"]) if args.smoke else (LOAD_S, DAG_CHANGES)
    planned = {name: RUNS[name] for name in SMOKE["runs"]} if args.smoke else RUNS
    choice_passed = None if args.smoke else queue_choice_test()
    load = CompetingLoad(hold_s)
    load.start()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            runs = {name: run_dag(Path(tmp) / name, changes, dag_changes) for name, changes in planned.items()}
    finally:
        load.stop()
    result = {
        **figures(runs, choice_passed),
        "runs": runs,
        "load": {"job_s": hold_s, "jobs": len(load.jobs), "shape": "2 nodes, one after another"},
        "provenance": provenance(),
        "settings": {
            "runs": planned,
            "dag_changes": dag_changes,
            "waited_s": WAITED_S,
            "profile": "profiles/slurm",
            "smoke": args.smoke,
        },
    }
    return write_and_report(args.out, result, report)

"""Slurm orchestration overhead on the local cluster (make slurm-up first).

Prints and writes bench/results/slurm_overhead.json (--out elsewhere):
- submit_to_start_s: median over trivial jobs of (job's first Python line) - (sbatch submission), through launch.run;
- dag: the whole tiny digits DAG through profiles/slurm: wall time, the union of the time its Slurm jobs ran
  (sacct Start..End), and the orchestration overhead = wall - union (Snakemake, submission, queueing, polling).
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import datetime
from pathlib import Path

import cloudpickle
import yaml

from tula_bench.common import REPO, bench_config, bench_parser, parse_bench_args, write_result
from tula_hpc.cluster import launch, slurm_states
from tula_hpc.core.atomic_files import read_json

# A launched process cannot import bench/'s modules: its worker (started_at) travels by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

TRIVIAL_JOBS = 7
# The default digits job, shortened so that the whole DAG takes about a minute.
DAG_CHANGES = {"train": {"epochs": 12, "lr_milestones": [9]}, "search": {"warmup_steps": 2, "steps": 4}}
# --smoke, CI's check that the bench runs end to end: two trivial jobs and the smallest DAG.
SMOKE = {
    "trivial_jobs": 2,
    "dag_changes": {"train": {"epochs": 2, "lr_milestones": []}, "search": {"warmup_steps": 1, "steps": 2}},
}


def started_at() -> float:
    return time.time()


def submit_to_start(workdir: Path, jobs: int = TRIVIAL_JOBS) -> list[float]:
    spec = launch.LaunchSpec(launcher="slurm", nodes=1, time_min=5, mem_gb=0.5)
    latencies = []
    for i in range(jobs):
        stage_dir = workdir / f"trivial{i}"
        start = launch.run(started_at, {}, spec, stage_dir, name="bench-trivial")
        latencies.append(start - read_json(stage_dir / "job.json")["submitted"])
    return latencies


def job_intervals(prefix: str) -> list[tuple[float, float]]:
    out = subprocess.run(
        ["sacct", "-n", "-X", "-P", "-S", "2020-01-01", "-o", "JobName,Start,End"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    stamp = lambda s: datetime.fromisoformat(s).timestamp()  # noqa: E731
    return sorted(
        (stamp(start), stamp(end))
        for name, start, end in (line.split("|") for line in out.splitlines())
        if name.startswith(prefix) and end not in ("Unknown", "")
    )


def union_length(intervals: list[tuple[float, float]]) -> float:
    total, current_start, current_end = 0.0, None, None
    for start, end in intervals:
        if current_end is None or start > current_end:
            total += (current_end - current_start) if current_end is not None else 0.0
            current_start, current_end = start, end
        else:
            current_end = max(current_end, end)
    return total + ((current_end - current_start) if current_end is not None else 0.0)


def dag_overhead(workdir: Path, dag_changes: dict = DAG_CHANGES) -> dict:
    name = f"bench{uuid.uuid4().hex[:6]}"  # a fresh name: its Slurm jobs are told apart in sacct by it
    config = bench_config(as_name=name, **dag_changes)
    del config["launcher"], config["slurm"]  # the profile's to set, as for any jobs file
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "jobs.yaml").write_text(yaml.safe_dump(config))
    started = time.time()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "snakemake",
            "-s",
            str(REPO / "Snakefile"),
            "-d",
            str(workdir),
            "--profile",
            str(REPO / "profiles" / "slurm"),
            "--configfile",
            str(workdir / "jobs.yaml"),
        ],
        check=True,
        capture_output=True,
    )
    wall = time.time() - started
    time.sleep(slurm_states.ACCOUNTING_LAG_S)
    intervals = job_intervals(f"{name}-")
    inside = union_length(intervals)
    return {
        "wall_s": wall,
        "slurm_jobs": len(intervals),
        "inside_jobs_s": inside,
        "orchestration_overhead_s": wall - inside,
        "overhead_fraction": (wall - inside) / wall,
    }


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, "slurm_overhead.json")
    parser.add_argument(
        "--smoke", action="store_true", help="SMOKE: two trivial jobs and the smallest DAG (CI's check)"
    )
    args = parse_bench_args(parser, argv)
    trivial_jobs, dag_changes = (
        (SMOKE["trivial_jobs"], SMOKE["dag_changes"]) if args.smoke else (TRIVIAL_JOBS, DAG_CHANGES)
    )
    env = (REPO / "work" / "slurm" / "slurm.env").read_text()
    os.environ["SLURM_CONF"] = re.search(r"SLURM_CONF=(\S+)", env).group(1)
    with tempfile.TemporaryDirectory() as tmp:
        dag = dag_overhead(Path(tmp) / "dag", dag_changes)
        latencies = submit_to_start(Path(tmp), trivial_jobs)
    figures = {
        "submit_to_start_s": {
            "median": statistics.median(latencies),
            "min": min(latencies),
            "max": max(latencies),
            "samples": latencies,
        },
        "dag": dag,
        "note": "1-second resolution for sacct Start/End; local cluster on 2 shared cores",
    }
    write_result(
        args.out,
        {"trivial_jobs": trivial_jobs, "dag_changes": dag_changes, "profile": "profiles/slurm", "smoke": args.smoke},
        figures,
    )
    print(
        f"submit-to-start median {figures['submit_to_start_s']['median']:.2f} s over {len(latencies)} jobs; "
        f"DAG wall {dag['wall_s']:.1f} s, inside {dag['slurm_jobs']} jobs {dag['inside_jobs_s']:.1f} s, "
        f"orchestration overhead {dag['orchestration_overhead_s']:.1f} s ({dag['overhead_fraction']:.0%})"
    )
    return 0

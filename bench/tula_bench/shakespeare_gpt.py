"""Benchmark: the issue's example, config/examples/shakespeare-gpt.yaml, run as a user runs it, over seeds.

Each seed runs the whole DAG (probe, profile, fit, select, train, evaluate, report) through Snakemake with
profiles/local in a fresh temporary folder, the example's jobs file with train.seed set by a second --configfile (an
overlay: Snakemake merges config files key by key). Per seed: eval.json's test loss (nats per character) against the
smoothed character trigram model's cross-entropy on the same test works (bench/tula_bench/ngram_baselines.py; the
unigram's beside it), met when at or below it; and each stage's wall time, from Snakemake's own log (a stage's first
start to its last finish: the profile stage is several jobs). Over seeds: the test loss's mean, standard deviation
and 95 % t interval, and whether every seed met the target.

Run:  flock /tmp/tula-cpu.lock .venv/bin/python bench/shakespeare_gpt.py [SEED ...]   (default seeds 0 1 2, up to
      10 minutes each; needs `make data`'s shakespeare archive; writes bench/results/shakespeare_gpt.json)
"""

from __future__ import annotations

import re
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import yaml

from tula_bench.common import REPO, bench_parser, dag_command, write_result
from tula_bench.generalization_fmnist import interval
from tula_hpc.core.atomic_files import read_json

EXAMPLE = REPO / "config" / "examples" / "shakespeare-gpt.yaml"
DEFAULT_SEEDS = (0, 1, 2)
RUN_TIMEOUT_S = 1800  # a seed should take at most 10 minutes; three times that is a hung run, not a slow one
# Snakemake's log: a timestamp line (time.asctime in brackets), then a job's first line and its jobid, or its end.
TIMESTAMP = re.compile(r"^\[(\w{3} \w{3} +\d+ \d\d:\d\d:\d\d \d{4})\]$")
STARTED = re.compile(r"^(?:local)?(?:rule|checkpoint) (\w+):$")
JOBID = re.compile(r"^\s+jobid: (\d+)$")
FINISHED = re.compile(r"^Finished jobid: (\d+) \(Rule: (\w+)\)$")


def example_job(example: Path = EXAMPLE) -> str:
    """The example's one job: the seed overlay names it."""
    jobs = list(yaml.safe_load(example.read_text())["jobs"])
    if len(jobs) != 1:
        raise SystemExit(f"{example}: the bench runs an example of one job, found {len(jobs)}: {', '.join(jobs)}")
    return jobs[0]


def seed_overlay(job: str, seed: int) -> dict:
    return {"jobs": {job: {"train": {"seed": seed}}}}


def stage_walls(log: str) -> dict[str, dict]:
    """Per rule (stage), from a Snakemake log: its jobs, their summed seconds, and its wall time, first start to
    last finish. A job without its finish (the run failed there) is left out."""
    started, now, rule = {}, None, None
    spans: dict[str, list[tuple[float, float]]] = {}
    for line in log.splitlines():
        if stamp := TIMESTAMP.match(line):
            now = time.mktime(time.strptime(stamp.group(1), "%a %b %d %H:%M:%S %Y"))
        elif begun := STARTED.match(line):
            rule = begun.group(1)
        elif (job := JOBID.match(line)) and rule is not None:
            started[job.group(1)], rule = (rule, now), None
        elif (done := FINISHED.match(line)) and done.group(1) in started:
            name, start = started.pop(done.group(1))
            spans.setdefault(name, []).append((start, now))
    return {
        name: {
            "jobs": len(jobs),
            "job_seconds": sum(end - start for start, end in jobs),
            "wall_s": max(end for _, end in jobs) - min(start for start, _ in jobs),
        }
        for name, jobs in spans.items()
    }


def seed_result(workdir: Path, job: str, seed: int, trigram_nats: float) -> dict:
    """A finished seed's figures: its test loss against the trigram's, and each stage's wall time (the newest of
    Snakemake's logs in `workdir`)."""
    scores = read_json(workdir / "results" / job / "eval.json")
    logs = sorted((workdir / ".snakemake" / "log").glob("*.snakemake.log"))
    if not logs:
        raise FileNotFoundError(f"{workdir}: no Snakemake log under .snakemake/log/")
    loss = scores["test_loss"]
    return {
        "seed": seed,
        "test_loss": loss,
        "test_bits": scores.get("test_bits"),
        "trigram_met": bool(loss <= trigram_nats),
        "stages": stage_walls(logs[-1].read_text()),
        "wall_time_s": scores.get("wall_time_s"),
    }


def over_seeds(seeds: list[dict], baselines: dict) -> dict:
    """The test loss over seeds (mean, std, 95 % t interval) and the target: every seed at or below the trigram."""
    losses = [s["test_loss"] for s in seeds]
    spread = interval(losses)
    return {
        "test_loss_mean": spread["mean"],
        "test_loss_std": statistics.stdev(losses) if len(losses) > 1 else None,
        "test_loss_ci95": spread["ci95"],
        "seeds": len(losses),
        "target": {
            "met": all(s["trigram_met"] for s in seeds),
            "figure": max(losses),
            "target": baselines["trigram_nats"],
            "what": "every seed's test loss (nats per character) at or below the character trigram model's",
        },
        "seeds_meeting_target": sum(s["trigram_met"] for s in seeds),
    }


def run_seed(job: str, seed: int, workdir: Path) -> None:
    """The example's whole DAG for one seed, as a user runs it (profiles/local), in `workdir`."""
    (workdir / "jobs.yaml").write_text(EXAMPLE.read_text())
    overlay = workdir / "seed.yaml"
    overlay.write_text(yaml.safe_dump(seed_overlay(job, seed)))
    with open(workdir / "snakemake.out", "w") as out:
        proc = subprocess.run(
            [*dag_command(workdir, "local"), str(overlay)], stdout=out, stderr=subprocess.STDOUT, timeout=RUN_TIMEOUT_S
        )
    if proc.returncode != 0:
        tail = (workdir / "snakemake.out").read_text()[-3000:]
        raise RuntimeError(f"seed {seed}: the DAG failed (exit {proc.returncode}) in {workdir}:\n{tail}")


def ngram_reference(job: str) -> dict:
    """The unigram and trigram models' test cross-entropy on the example's own data set's test works."""
    from tula_bench.ngram_baselines import baselines
    from tula_hpc.config import job_settings, load_config
    from tula_hpc.training.data_check import shakespeare_archive
    from tula_hpc.training.text import shakespeare_streams, shakespeare_works

    data = job_settings(load_config([EXAMPLE]), job).data
    return baselines(*shakespeare_streams(shakespeare_works(shakespeare_archive(data))))


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, "shakespeare_gpt.json")
    parser.add_argument("seeds", nargs="*", type=int, default=list(DEFAULT_SEEDS), help="train.seed of each run")
    parser.add_argument("--keep", action="store_true", help="keep each seed's folder (printed) for inspection")
    args = parser.parse_args(argv)
    job = example_job()
    reference = ngram_reference(job)
    print(f"test works: unigram {reference['unigram_nats']:.3f}, trigram {reference['trigram_nats']:.3f} nats/char")
    seeds = []
    for seed in args.seeds:
        workdir = Path(tempfile.mkdtemp(prefix=f"shakespeare-gpt-seed{seed}-"))
        run_seed(job, seed, workdir)
        seeds.append(seed_result(workdir, job, seed, reference["trigram_nats"]))
        walls = ", ".join(f"{name} {s['wall_s']:.0f} s" for name, s in seeds[-1]["stages"].items())
        print(f"seed {seed}: test loss {seeds[-1]['test_loss']:.3f} nats/char; {walls}  ({workdir})", flush=True)
        if not args.keep:
            shutil.rmtree(workdir)
    figures = {**over_seeds(seeds, reference), "baselines": reference, "per_seed": seeds}
    settings = {"example": EXAMPLE.relative_to(REPO).as_posix(), "job": job, "seeds": args.seeds, "profile": "local"}
    write_result(args.out, {**settings, "example_config": yaml.safe_load(EXAMPLE.read_text())}, figures)
    t = figures["target"]
    print(
        f"test loss {figures['test_loss_mean']:.3f} +- {figures['test_loss_std'] or 0:.3f} nats/char over "
        f"{len(seeds)} seeds; target {'met' if t['met'] else 'NOT met'}: worst {t['figure']:.3f} <= trigram "
        f"{t['target']:.3f} ({figures['seeds_meeting_target']} of {len(seeds)} seeds)"
    )
    return 0

"""What every benchmark shares: the job it measures and the header of the file it writes.

A bench job is config/jobs.yaml's job with the bench's changes merged in and validated as the workflow
validates it, so a bench measures what the workflow would run and a bad bench setting fails on the spot,
naming the field. A result file starts with the git commit, the processor and every setting
(the design page ../shared/DESIGN.md, outside this
repository, "Benchmark protocol"): a figure without them cannot be checked or compared.
"""

from __future__ import annotations

import argparse
import atexit
import copy
import functools
import hashlib
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

import yaml

from tula_hpc.config import ConfigError, job_settings, load_config, validate_config
from tula_hpc.core.atomic_files import write_json
from tula_hpc.core.job import Job

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"  # the scripts; their code is this package
RESULTS = BENCH / "results"
WORK = REPO / "work" / "bench"  # scratch: stage folders, finished cells
GPU_CASES = REPO / "bench" / "data" / "gpu"  # what GPU runs recorded, for the replays (README there)
JOBS_FILE = REPO / "config" / "jobs.yaml"
DEFAULT_JOB = "digits-cnn"


def merged(base: dict, changes: dict) -> dict:
    """A copy of `base` with `changes` merged in: mappings key by key, anything else replaced."""
    out = copy.deepcopy(base)
    for key, value in changes.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


@functools.cache
def _jobs_file() -> dict:
    """config/jobs.yaml as written (checked first): defaults are filled after a bench's changes, so that those that
    depend on another field (search.sync_prior on resources.gpus_per_node) follow the bench's value of it."""
    load_config([JOBS_FILE])
    return yaml.safe_load(JOBS_FILE.read_text())


def bench_config(name: str = DEFAULT_JOB, *, as_name: str | None = None, launcher: str = "local", **sections) -> dict:
    """config/jobs.yaml holding only job `name` (renamed `as_name`), each of its sections updated by
    `sections` (e.g. train={"epochs": 3}), validated with defaults filled in."""
    config = _jobs_file()
    if name not in config["jobs"]:
        raise ConfigError(f"{JOBS_FILE}: job '{name}' is not defined; defined jobs: {', '.join(config['jobs'])}")
    job = merged(config["jobs"][name], sections)
    bench = {"launcher": launcher, "slurm": copy.deepcopy(config.get("slurm", {})), "jobs": {as_name or name: job}}
    try:
        return validate_config(bench)
    except ConfigError as err:
        raise ConfigError(f"bench job from {JOBS_FILE.name} '{name}' with {sections}: {err}") from None


def bench_job(name: str = DEFAULT_JOB, *, as_name: str | None = None, launcher: str = "local", **sections) -> Job:
    """The validated settings of that bench job, as a stage receives them (`job_settings`)."""
    return job_settings(bench_config(name, as_name=as_name, launcher=launcher, **sections), as_name or name)


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()


def processor() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _commit() -> tuple[str, bool | None]:
    """The commit measured and whether the tree had uncommitted changes (the commit alone does not say what ran).

    The caller's TULA_GIT_COMMIT wins, its changes unknown: a copy without its own .git (the GPU machine's) may sit
    in another repository's work tree, and git would answer for that one. Else git's answer."""
    if named := os.environ.get("TULA_GIT_COMMIT"):
        return named, None
    return _git("rev-parse", "HEAD"), bool(_git("status", "--porcelain", "--untracked-files=no"))


def provenance() -> dict:
    """The code and machine a figure was measured with."""
    import torch

    commit, dirty = _commit()
    return {
        "git_commit": commit,
        "git_dirty": dirty,
        "processor": processor(),
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "cpus": len(os.sched_getaffinity(0)),
        "python": platform.python_version(),
        "torch": version("torch"),
        "written_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def files_digest(paths: list[str], settings: object = None) -> str:
    """A short hash of these repository files (paths relative to REPO; a folder stands for the files under it, caches
    and bench/results left out) and `settings`: equal digests mean the same code with the same settings, without
    relying on git. A path that does not exist is an error: a cache keyed on code that is no longer there would be
    reused after any change."""
    digest = hashlib.sha256()
    for path in paths:
        top = REPO / path
        if not top.exists():  # a moved module would otherwise drop out of the digest unseen
            raise FileNotFoundError(f"files_digest: '{path}' is not in the repository (moved or renamed?)")
        for file in [top] if top.is_file() else sorted(top.rglob("*")):
            relative = file.relative_to(REPO).as_posix()
            if file.is_file() and "__pycache__" not in relative and not relative.startswith("bench/results"):
                digest.update(relative.encode() + b"\0" + file.read_bytes() + b"\0")
    digest.update(json.dumps(settings, sort_keys=True, default=str).encode())
    return digest.hexdigest()[:16]


def stage_code(*stages: str) -> list[str]:
    """The package files a run of these stage modules can import: every folder and module below stages/ in the
    import layers (tests/unit/test_imports.py holds the package to them) and the named stages with their runner,
    since stage modules never import each other. Derived from the package's layout, so a move cannot leave it
    behind."""
    package = REPO / "tula_hpc"
    above = {"stages", "cli.py", "__pycache__"}
    below = sorted(p.relative_to(REPO).as_posix() for p in package.iterdir() if p.name not in above)
    return below + [f"tula_hpc/stages/{name}.py" for name in ("__init__", "runner", *stages)]


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def new_case_path(folder: Path, device_name: str, case: str) -> Path:
    """bench/data/gpu/<device>-<date>-<case>.json, numbered after the first where that name is taken: a recorded case
    is never rewritten."""
    stem = f"{slug(device_name)}-{time.strftime('%Y-%m-%d')}-{case}"
    path, n = folder / f"{stem}.json", 2
    while path.exists():
        path, n = folder / f"{stem}-{n}.json", n + 1
    return path


def read_case(path: Path, kind: str, required: tuple[str, ...]) -> dict:
    """A recorded GPU case of `kind` (bench/data/gpu/README.md); a file of another kind is an error that names it."""
    case = json.loads(path.read_text())
    if missing := [key for key in required if key not in case]:
        raise SystemExit(f"{path}: not a {kind} case (no {', '.join(missing)}); see {GPU_CASES / 'README.md'}")
    return case


def write_result(path: Path, settings: dict, figures: dict) -> None:
    """A result file: provenance, then every setting, then the figures."""
    write_json(path, {"provenance": provenance(), "settings": settings, **figures})
    print(f"wrote {path}", flush=True)


def bench_parser(doc: str, result_name: str) -> argparse.ArgumentParser:
    """The bench's command line, with --out (default bench/results/<result_name>)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS / result_name, help="result file (default %(default)s)")
    return parser


def smoke_scratch(name: str) -> Path:
    """A smoke run's own folder, fresh (no cached cell skips its work) and removed when the run ends."""
    folder = Path(tempfile.mkdtemp(prefix=f"{name}-smoke-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def parse_bench_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """The command line of a bench with --smoke (its smallest case, the same code: CI's check that it runs end to end):
    a smoke run names its --out, so its result never replaces bench/results/."""
    args = parser.parse_args(argv)
    if args.smoke and args.out in (None, parser.get_default("out")):
        parser.error("--smoke needs --out: a smoke result never replaces bench/results/")
    return args


def write_and_report(out: Path, result: dict, report) -> int:
    """A bench's last lines: the result file, where it went, and `report(result)`'s figures; exit status 0."""
    write_json(out, result)
    print(f"wrote {out}", flush=True)
    report(result)
    return 0


def verdict(figure: float | None, target: float) -> dict:
    """A target as met or not, with its figure (a figure that could not be measured meets nothing)."""
    figure = None if figure is None else float(figure)
    return {"met": figure is not None and figure <= target, "figure": figure, "target": target}


def error_summary(errors: dict[str, float | None]) -> dict:
    """Median and largest |relative error| over labelled errors (None: not measured, left out), and the label of the
    largest."""
    errors = {label: error for label, error in errors.items() if error is not None}
    if not errors:
        return {"count": 0, "median_rel_error": None, "max_rel_error": None, "worst": None}
    worst = max(errors, key=lambda label: abs(errors[label]))
    return {
        "count": len(errors),
        "median_rel_error": float(statistics.median(abs(e) for e in errors.values())),
        "max_rel_error": float(abs(errors[worst])),
        "worst": worst,
    }


def train_cell(job: Job, global_batch: int, run_dir: Path, world: int, name: str, **worker) -> dict:
    """One training run as the train stage runs it: train_worker on `world` ranks (with `worker`'s other arguments,
    e.g. a batch schedule), a job of its own (launch.run); the summary. A run interrupted earlier resumes from its
    checkpoint in `run_dir`, which gives the uninterrupted result."""
    import contextlib

    from tula_hpc.cluster import launch
    from tula_hpc.training.trainer import train_worker

    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "launch.log", "a") as log, contextlib.redirect_stdout(log):
        summary = launch.run(
            train_worker,
            dict(
                job=job,
                global_batch=global_batch,
                checkpoint_path=str(run_dir / "checkpoint.pt"),
                model_path=str(run_dir / "model.pt"),
                metrics_path=str(run_dir / "metrics.jsonl"),
                **worker,
            ),
            launch.LaunchSpec.for_job(job, nodes=world),
            run_dir,
            name=name,
        )
    if summary.get("outcome", "completed") != "completed":
        raise RuntimeError(f"{run_dir.name} did not train: {summary}")
    return summary


def trained_scores(job: Job, model_path: Path) -> dict:
    """The evaluate stage's scores of the saved model (test accuracy after precise BN and as trained), and its
    validation accuracy after precise BN, the figure benchmarks choose settings on (the evaluate stage scores the
    test split only, so the validation split is scored here with its functions)."""
    import torch

    from tula_hpc.cluster.distributed import Context
    from tula_hpc.training.datasets import load_splits
    from tula_hpc.training.evaluation import evaluate_worker, load_trained_model, score
    from tula_hpc.training.precision import Precision
    from tula_hpc.training.tasks import job_task

    model, device = load_trained_model(model_path), torch.device("cpu")
    splits = load_splits(job.data, job.train.seed)
    precision = Precision(job.train.precision, device, job.train.channels_last)
    val, _ = score(model, splits, Context(0, 1, 0, device), splits.val, job_task(job), 256, precision, job.train.seed)
    return {**evaluate_worker(job, str(model_path)), "val_accuracy_precise_bn": val["accuracy"]}


def use_local_cluster() -> None:
    """Point this process (and what it starts) at the local Slurm cluster `make slurm-up` started."""
    env = (REPO / "work" / "slurm" / "slurm.env").read_text()
    os.environ["SLURM_CONF"] = re.search(r"SLURM_CONF=(\S+)", env).group(1)


def dag_command(workdir: Path, profile: str) -> list[str]:
    """This checkout's DAG in `workdir` under profiles/`profile`, with the jobs file workdir/jobs.yaml."""
    cmd = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "-d", str(workdir)]
    return cmd + ["--profile", str(REPO / "profiles" / profile), "--configfile", str(workdir / "jobs.yaml")]

"""The command line every stage shares: which jobs file, which job, which launcher; clean failures."""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

from tula_hpc.config import ConfigError, job_settings, load_config
from tula_hpc.core.atomic_files import StageInputError
from tula_hpc.core.errors import StageError
from tula_hpc.core.job import Job


def load_job(config_paths: list[Path], job_name: str, launcher: str | None = None, slurm: dict | None = None) -> Job:
    config = load_config(config_paths, {"launcher": launcher, "slurm": slurm})
    return job_settings(config, job_name)


def stage_main(
    name: str,
    add_args: Callable[[argparse.ArgumentParser], None],
    run: Callable[[Job, argparse.Namespace], object],
    argv: list[str] | None = None,
) -> int:
    parser = argparse.ArgumentParser(prog=f"tula-hpc {name}", description=f"tula-hpc stage {name}")
    # Defaults come from the environment the Snakefile sets up, so rules need not repeat them.
    configfiles = os.environ.get("TULA_CONFIGFILES", "config/jobs.yaml").split(os.pathsep)
    parser.add_argument(
        "--config",
        type=Path,
        nargs="+",
        default=[Path(p) for p in configfiles],
        help="jobs file(s), merged in order as Snakemake merges configfiles (env TULA_CONFIGFILES)",
    )
    parser.add_argument("--job", required=True, help="job name in the jobs file")
    parser.add_argument(
        "--launcher",
        choices=["local", "slurm"],
        default=os.environ.get("TULA_LAUNCHER"),
        help="local or slurm (env TULA_LAUNCHER; default: the jobs file's)",
    )
    parser.add_argument(
        "--slurm",
        type=json.loads,
        default=os.environ.get("TULA_SLURM"),
        help="cluster-wide Slurm settings as JSON, from the profile (env TULA_SLURM)",
    )
    parser.add_argument("--work-dir", type=Path, help="work/{job}: submitit folders, checkpoints (default work/JOB)")
    add_args(parser)
    args = parser.parse_args(argv)
    if args.work_dir is None:
        args.work_dir = Path("work") / args.job
    try:
        job = load_job(args.config, args.job, args.launcher, args.slurm)
        run(job, args)
    except (ConfigError, StageInputError, StageError) as err:
        print(f"tula-hpc {name}: error: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # a failed job or a bug: show what to read, exit non-zero
        from tula_hpc.cluster.allocation import AllocationFailed
        from tula_hpc.cluster.launch import JobFailed
        from tula_hpc.cluster.slurm_states import CancelFailed

        if not isinstance(err, (JobFailed, AllocationFailed, CancelFailed)):
            traceback.print_exc()
        print(f"tula-hpc {name}: failed: {err}", file=sys.stderr)
        return 1
    return 0

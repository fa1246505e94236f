"""The job record (job.json beside a stage's work): written when a job is submitted, read when the stage runs again,
so that a rerun re-attaches to a job that still runs (or left its results) instead of submitting a duplicate."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import submitit

from tula_hpc.cluster.launch_spec import LaunchSpec
from tula_hpc.cluster.launchers.interface import DistributedTask, Launcher
from tula_hpc.cluster.launchers.registry import LAUNCHERS
from tula_hpc.core.atomic_files import read_json, write_json

RECORD = "job.json"


def submit(launcher: Launcher, task: DistributedTask, spec: LaunchSpec, stage_dir: Path, name: str) -> submitit.Job:
    """Submit the task in a fresh folder and record the job beside the stage's work (job.json) for a rerun: first
    before it starts (with its id where known ahead, a shared allocation's), so that a driver killed while the job
    starts leaves a record its rerun finds the job by, then with the id and what the launcher keeps of it."""
    folder = stage_dir / f"submit-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    job_id_ahead = launcher.job_id_ahead(spec)
    record = {
        "launcher": launcher.name,
        "name": name,
        "job_id": job_id_ahead,
        "folder": str(folder.resolve()),
        "tasks": spec.world_size,
        "nodes": spec.nodes,
        "submitted": time.time(),
    }
    write_json(stage_dir / RECORD, record)
    job = launcher.submit(spec, folder, name, task, job_id_ahead)
    write_json(stage_dir / RECORD, {**record, "job_id": str(job.job_id), **launcher.record(job)})
    print(
        f"[tula-hpc] submitted {launcher.name} job {job.job_id} ({spec.nodes} node(s), {spec.world_size} task(s)); "
        f"logs in {folder}",
        flush=True,
    )
    return job


def reattach(stage_dir: Path) -> tuple[Launcher, submitit.Job] | None:
    """The job an earlier run of the stage recorded, with the launcher that started it (the job is of the kind
    recorded, whatever the settings say now), if it still runs or left its results; else None."""
    record_path = stage_dir / RECORD
    if not record_path.exists():
        return None
    record = read_json(record_path)
    launcher = LAUNCHERS[record["launcher"]]
    job = launcher.reattach(record)
    if job is None:
        return None
    print(f"[tula-hpc] re-attached to {record['launcher']} job {job.job_id} of an earlier run", flush=True)
    return launcher, job

"""The local Slurm cluster (scripts/slurm/up.sh) for tests that submit real sbatch jobs.

Without root the cluster cannot start and these tests skip, saying why; under CI (CI=true) they must run.
"""

from __future__ import annotations

import os
import re
import subprocess
import uuid
from datetime import datetime
from pathlib import Path

import pytest

from tests.conftest import REPO, wait_for
from tula_hpc.cluster import launch
from tula_hpc.cluster.allocation import release_allocation
from tula_hpc.cluster.launch_spec import Allocation

pytestmark = pytest.mark.slurm
STATE = Path(os.environ.get("TULA_SLURM_DIR", REPO / "work" / "slurm"))
SCRIPTS = REPO / "scripts" / "slurm"


def _unavailable(reason: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"Slurm tests are required under CI but {reason}")
    pytest.skip(reason)


def _cluster_answers(env_file: Path) -> str | None:
    """SLURM_CONF of a running cluster whose controller and accounting both answer, else None."""
    if not env_file.exists():
        return None
    conf = re.search(r"SLURM_CONF=(\S+)", env_file.read_text()).group(1)
    env = {**os.environ, "SLURM_CONF": conf}
    for probe in (["sinfo", "-h", "-t", "idle,mix,alloc", "-o", "%D"], ["sacct", "-n", "-X", "-j", "1"]):
        proc = subprocess.run(probe, env=env, capture_output=True, text=True)
        if proc.returncode != 0 or (probe[0] == "sinfo" and not proc.stdout.strip()):
            return None
    return conf


def running_site() -> str:
    """The site profile the local cluster was started as (scripts/slurm/sites/); one older than profiles was
    permissive."""
    site_file = STATE / "site"
    return site_file.read_text().strip() if site_file.exists() else "permissive"


def start_site(site: str) -> str:
    """scripts/slurm/up.sh as site profile `site` (a cluster of another profile is restarted fresh); its SLURM_CONF."""
    proc = subprocess.run(
        ["bash", str(SCRIPTS / "up.sh")], env={**os.environ, "TULA_SLURM_SITE": site}, capture_output=True, text=True
    )
    if proc.returncode != 0:
        _unavailable(f"scripts/slurm/up.sh (site {site}) failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return _cluster_answers(STATE / "slurm.env")


@pytest.fixture(scope="session")
def slurm_cluster(request) -> Path:
    """Use the running local cluster, or start it and stop it when the session ends; point this process at it.

    A cluster the session found running is left running: someone else may be using it. The tests expect the
    `permissive` site profile: a cluster found running as another is restarted so (a module asks for another
    profile with a fixture such as `strict_site`).
    """
    if os.geteuid() != 0:
        _unavailable("the local Slurm cluster needs root (run `make slurm-up` as root)")
    conf = _cluster_answers(STATE / "slurm.env")
    if conf is None:
        # Registered first: a half-started cluster is stopped too.
        request.addfinalizer(lambda: subprocess.run(["bash", str(SCRIPTS / "down.sh")], capture_output=True))
    if conf is None or running_site() != "permissive":
        conf = start_site("permissive")
    os.environ["SLURM_CONF"] = conf
    return Path(conf)


@pytest.fixture(scope="module")
def strict_site(slurm_cluster: Path):
    """The cluster restarted as site profile `strict` (scripts/slurm/sites/strict.sh) for the module's tests, and as
    `permissive` again once they are done: the other modules never see it, whatever order runs. The restart keeps
    the state directory, so SLURM_CONF stays."""
    start_site("strict")
    yield slurm_cluster
    start_site("permissive")


def sacct_jobs(name: str, known: tuple[str, ...] = ()) -> list[dict]:
    """Allocations (not steps) named `name`, oldest first, once accounting lists the `known` ids: slurmctld hands a
    job to slurmdbd asynchronously, so a job submitted a moment ago may not be listed yet."""

    def listed() -> list[dict] | None:
        out = subprocess.run(
            ["sacct", "-n", "-X", "-P", "-S", "2020-01-01", "--name", name, "-o", "JobID,NNodes,State"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        rows = [dict(zip(("job_id", "nodes", "state"), line.split("|"))) for line in out.splitlines() if line]
        return rows if set(known) <= {row["job_id"] for row in rows} else None

    return wait_for(listed, 60, f"accounting to list jobs {', '.join(known)} named {name}") if known else listed()


def sacct_steps(job_id: str) -> list[dict]:
    """The job steps of allocation `job_id` that ran a command (not its batch shell or extern step), oldest first."""
    out = subprocess.run(
        ["sacct", "-n", "-P", "-j", job_id, "-o", "JobID,JobName,NNodes,State"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rows = [dict(zip(("step_id", "name", "nodes", "state"), line.split("|"))) for line in out.splitlines() if line]
    return [row for row in rows if row["step_id"].split(".")[-1].isdigit() and "." in row["step_id"]]


def step_end_time(job_id: str) -> float:
    """When the job's first step (the srun of every rank) ended, from accounting (whole seconds)."""

    def recorded_end() -> str | None:
        out = subprocess.run(["sacct", "-n", "-P", "-j", f"{job_id}.0", "-o", "End"], capture_output=True, text=True)
        end = out.stdout.strip().splitlines()[0] if out.stdout.strip() else ""
        return end if end not in ("", "Unknown") else None

    return datetime.fromisoformat(wait_for(recorded_end, 30, f"accounting of job {job_id}'s step")).timestamp()


def measuring_spec(request, tmp_path: Path, allocation: str, **spec) -> tuple[launch.LaunchSpec, Path]:
    """A measurement's LaunchSpec on the local cluster and its job's work folder (a fresh name): its own sbatch job
    (allocation per_stage) or a step of a shared allocation of both nodes, given back when the test ends."""
    work = tmp_path / f"m{uuid.uuid4().hex[:8]}"
    shared = None
    if allocation == "shared":
        shared = Allocation(str(work / "allocation"), nodes=2, gpus_per_node=0, time_min=spec["time_min"])
        request.addfinalizer(lambda: release_allocation(work))
    return launch.LaunchSpec(launcher="slurm", allocation=shared, **spec), work

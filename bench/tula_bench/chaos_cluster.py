"""The local Slurm cluster between the fault benches' trials: `make slurm-down` and `make slurm-up` after every trial
(no daemon may outlive the first, the second must work at once), and the site profile it runs
(scripts/slurm/up.sh reads TULA_SLURM_SITE: permissive, today's cluster, or strict, a site's settings)."""

from __future__ import annotations

import os
import subprocess
import time

import psutil

from tula_bench.chaos_faults import POLL_S, SLURM
from tula_bench.common import use_local_cluster

SLURM_DAEMONS = {"slurmctld", "slurmd", "slurmstepd", "slurmdbd", "munged", "mariadbd"}
SITE_ENV = "TULA_SLURM_SITE"


def slurm_cycle() -> dict:
    """`make slurm-down`, the cluster's daemons still alive right after it (waited out, up to 30 s), then
    `make slurm-up` at once: whether each worked, and how long it took."""
    began = time.time()
    down = subprocess.run(["bash", str(SLURM / "down.sh")], capture_output=True, text=True)
    cycle = {"down_ok": down.returncode == 0, "down_s": round(time.time() - began, 1)}
    cycle["alive_after_down"] = alive = [f"{p.info['name']}:{p.pid}" for p in slurm_daemons()]
    cycle["zombies_after_down"] = len(slurm_daemons(zombies=True))
    deadline = time.time() + 30
    while alive and slurm_daemons() and time.time() < deadline:
        time.sleep(POLL_S)
    cycle["alive_after_30s"] = [f"{p.info['name']}:{p.pid}" for p in slurm_daemons()]
    began = time.time()
    up = subprocess.run(["bash", str(SLURM / "up.sh")], capture_output=True, text=True)
    cycle.update(up_ok=up.returncode == 0, up_s=round(time.time() - began, 1))
    if not (cycle["down_ok"] and cycle["up_ok"]):
        raise SystemExit(f"make slurm-down/up failed between trials: {cycle}\n{down.stderr}\n{up.stderr}")
    return cycle


def slurm_daemons(zombies: bool = False) -> list[psutil.Process]:
    """The cluster's daemons that run (or, `zombies`, that ended and wait to be reaped). A daemon's parent is gone,
    so a stopped daemon stays listed until PID 1 reaps it (seconds later in this container): zombies are not alive,
    and once read as slurmd alive after slurm-down."""
    return [
        p
        for p in psutil.process_iter(["name", "status"])
        if p.info["name"] in SLURM_DAEMONS and (p.info["status"] == psutil.STATUS_ZOMBIE) == zombies
    ]


def switch_site(site: str) -> dict:
    """The cluster restarted under site profile `site` (slurm_cycle's record). The profile is set in this process's
    environment, so every later up.sh (the next slurm_cycle, restart_slurmctld's) keeps it."""
    os.environ[SITE_ENV] = site
    cycle = slurm_cycle()
    use_local_cluster()
    return {"site": site, **cycle}

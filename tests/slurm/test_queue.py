"""The queue in view on the local cluster: the partition's real limits, Slurm's own start estimates, and a
configuration that would start later passed over exactly when its wait outweighs what it saves."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import pytest

from tests.conftest import default_job, wait_for
from tests.slurm.conftest import SCRIPTS, STATE
from tula_hpc.cluster import partition as cluster
from tula_hpc.cluster.slurm_states import slurm_state
from tula_hpc.performance.choice import select
from tula_hpc.stages.select import with_queue_waits

BLOCK_MIN = 10  # the competing job's time limit: Slurm's estimate of when its node is free again


@pytest.fixture
def second_node_busy(slurm_cluster):
    """A competing job holding node2 whole for BLOCK_MIN minutes (stopped at the end): a 2-node job must wait."""
    blocker = subprocess.run(
        ["sbatch", "--parsable", "--job-name=competing-load", "--nodelist=node2", "--exclusive", "--mem=0"]
        + [f"--time={BLOCK_MIN}", "--wrap", "sleep 3600"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    try:
        wait_for(lambda: slurm_state(blocker) == "RUNNING", 60, "the competing job to run")
        yield blocker
    finally:
        subprocess.run(["scancel", blocker], check=False)


def test_the_partitions_limits_come_from_scontrol(slurm_cluster):
    limits = cluster.partition_limits(None)
    assert (limits.partition, limits.nodes, limits.max_nodes, limits.max_time_s) == ("debug", 2, None, 4 * 3600)
    kept, excluded = cluster.within_partition([{"nodes": 2}, {"nodes": 4}], limits)
    assert kept == [{"nodes": 2}] and excluded[0]["breaks"] == ["4 nodes > the 2 nodes of partition debug"]


def test_a_later_start_is_passed_over_exactly_when_its_wait_outweighs_its_saving(second_node_busy):
    """2 nodes train faster than 1 but start when the competing job's limit ends: chosen when they save 2 minutes
    more than Slurm says they wait, passed over when they save 2 minutes less."""
    job = default_job(objective={"minimize": "time", "queue": "estimate"}).updated(launcher="slurm")

    def candidates(saving_s: float) -> list[dict]:
        one = {"nodes": 1, "batch": 64, "per_device_batch": 64, "time_s": 2000.0, "cost": 1.0, "rel_uncertainty": 0.0}
        two = {**one, "nodes": 2, "per_device_batch": 32, "time_s": 2000.0 - saving_s, "cost": 2.0}
        return [one, two]

    def choose(saving_s: float) -> int:
        chosen = select(
            with_queue_waits(job, candidates(saving_s)), "node_hour", job.objective, job.train.lr_base_batch
        )
        return chosen["chosen"]["nodes"]

    waits = {c["nodes"]: c["wait_s"] for c in with_queue_waits(job, candidates(0.0))}
    assert waits[1] == 0.0 and BLOCK_MIN * 60 - 120 < waits[2] <= BLOCK_MIN * 60, waits
    assert choose(waits[2] + 120) == 2
    assert choose(waits[2] - 120) == 1


def test_the_partitions_limits_are_read_once_slurmctld_is_back(slurm_cluster):
    """bench/chaos.py found it: the plan stage's scontrol failed the run while slurmctld restarted. Now it is asked
    again until slurmctld answers."""
    controller = int((STATE / "pids" / "slurmctld.pid").read_text())
    os.kill(controller, signal.SIGTERM)
    wait_for(lambda: subprocess.run(["scontrol", "ping"], capture_output=True).returncode != 0, 60, "slurmctld to stop")
    found = []
    asking = threading.Thread(target=lambda: found.append(cluster.partition_limits(None)))
    asking.start()
    try:
        time.sleep(8)  # scontrol fails meanwhile
        assert asking.is_alive() and not found, "the partition's limits were given up on while slurmctld was away"
    finally:
        subprocess.run(["bash", str(SCRIPTS / "up.sh")], check=True, capture_output=True)
    asking.join(timeout=120)
    assert [limits.partition for limits in found] == ["debug"]

"""tula_hpc.cluster.partition on Slurm's recorded output: durations, partition limits, --test-only starts, wall
times."""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
import subprocess

import pytest

from tests.conftest import default_job, fake_commands
from tula_hpc.cluster import partition as cluster
from tula_hpc.core.job import Job, SlurmSettings

# `scontrol show partition -o` of a cluster with a GPU partition (its default) and a CPU one
PARTITIONS = (
    "PartitionName=gpu AllowGroups=ALL AllowAccounts=ALL AllowQos=ALL AllocNodes=ALL Default=YES QoS=N/A "
    "DefaultTime=NONE DisableRootJobs=NO ExclusiveUser=NO GraceTime=0 Hidden=NO MaxNodes=4 MaxTime=2-00:00:00 "
    "MinNodes=0 LLN=NO MaxCPUsPerNode=UNLIMITED Nodes=g[01-08] PriorityJobFactor=1 PriorityTier=1 RootOnly=NO "
    "ReqResv=NO OverSubscribe=NO OverTimeLimit=NONE PreemptMode=OFF State=UP TotalCPUs=512 TotalNodes=8 "
    "SelectTypeParameters=NONE JobDefaults=(null) DefMemPerNode=UNLIMITED MaxMemPerNode=UNLIMITED "
    "TRES=cpu=512,mem=4000G,node=8,billing=512,gres/gpu=32\n"
    "PartitionName=cpu AllowGroups=ALL Default=NO MaxNodes=UNLIMITED MaxTime=UNLIMITED Nodes=c[1-2] State=UP "
    "TotalCPUs=4 TotalNodes=2 TRES=cpu=4,mem=7800M,node=2,billing=4\n"
)


@pytest.mark.parametrize(
    "text, seconds",
    [
        ("30", 1800),
        ("30:15", 1815),
        ("01:30:00", 5400),
        ("2-00:00:00", 172800),
        ("1-12", 129600),
        ("1-02:03", 93780),
        ("UNLIMITED", None),
        ("INFINITE", None),
    ],
)
def test_slurm_durations(text, seconds):
    assert cluster.parse_duration(text) == seconds


def test_partition_limits_from_scontrol():
    partitions = cluster.parse_partitions(PARTITIONS)
    gpu = partitions["gpu"]
    assert partitions["default"] is gpu
    assert (gpu.nodes, gpu.max_nodes, gpu.max_time_s, gpu.gpus_per_node) == (8, 4, 172800, 4)
    cpu = partitions["cpu"]
    assert (cpu.nodes, cpu.max_nodes, cpu.max_time_s, cpu.gpus_per_node) == (2, None, None, None)


def test_candidates_beyond_the_partition_are_left_out_naming_the_limit():
    gpu = cluster.parse_partitions(PARTITIONS)["gpu"]
    grid = [{"nodes": n, "gpus_per_node": g, "batch": 256} for n in (2, 8, 16) for g in (4, 8)]
    kept, excluded = cluster.within_partition(grid, gpu)
    assert [(c["nodes"], c["gpus_per_node"]) for c in kept] == [(2, 4)]
    by_shape = {(c["nodes"], c["gpus_per_node"]): c["breaks"] for c in excluded}
    assert by_shape[(2, 8)] == ["8 GPUs per node > the 4 of partition gpu's nodes"]
    assert by_shape[(8, 4)] == ["8 nodes > partition gpu's MaxNodes=4"]
    assert len(by_shape[(16, 8)]) == 3 and "16 nodes > the 8 nodes of partition gpu" in by_shape[(16, 8)]


def test_an_unknown_partition_is_named_with_the_known_ones(monkeypatch):
    monkeypatch.setattr(cluster, "_slurm", lambda cmd: subprocess.CompletedProcess(cmd, 0, PARTITIONS, ""))
    assert cluster.partition_limits(None).partition == "gpu"
    with pytest.raises(cluster.ClusterError, match="no partition 'big'; partitions: cpu, gpu"):
        cluster.partition_limits("big")


def test_test_only_start_and_its_command():
    text = "sbatch: Job 1734 to start at 2026-11-24T21:07:45 using 4 processors on nodes c[1-2] in partition cpu\n"
    assert cluster.parse_test_only(text) == dt.datetime(2026, 11, 24, 21, 7, 45)
    with pytest.raises(cluster.ClusterError, match="no start time"):
        cluster.parse_test_only("sbatch: error: Batch job submission failed: Requested node configuration")
    cmd = cluster.test_only_command(2, 4, 90, ["--partition=gpu", "--gpus-per-node=4"])
    assert cmd[:2] == ["sbatch", "--test-only"] and "--nodes=2" in cmd and "--gpus-per-node=4" in cmd
    assert "--time=90" in cmd and cmd[-2:] == ["--wrap", "true"]
    assert not any("gpus" in part for part in cluster.test_only_command(1, 0, 5, []))


def test_the_test_only_and_holder_options_come_from_resources_slurm_as_the_jobs_do():
    slurm = SlurmSettings(gpu_type="a100", mem_per_gpu_gb=16, wckey="proj7", extra_args=("-p gpu --exclusive",))
    args = cluster.sbatch_args(slurm, cpus_per_task=8, mem_gb=64, gpus_per_node=4)
    assert args == [
        "--cpus-per-task=8",
        "--gpus-per-node=a100:4",
        "--mem-per-gpu=16384M",
        "--requeue",
        "--wckey=proj7",
        "--partition=gpu",
        "--exclusive",
    ]
    assert cluster.sbatch_args(SlurmSettings(), 1, 2, 0) == ["--cpus-per-task=1", "--mem=2048M", "--requeue"]


def _slurm_job(**resources) -> Job:
    return default_job().updated(launcher="slurm", resources=resources, train={"epochs": 10})


def test_the_train_wall_time_follows_the_prediction_capped_by_max_time():
    job = _slurm_job(time_margin=0.5)
    candidate = {"time_s": 1000.0, "rel_uncertainty": 0.1}
    # (1000 x 1.2 + one epoch of 100 s) x 1.5 + the start-up
    assert cluster.train_time_limit_s(job, candidate, 1000.0, None) == pytest.approx(1950 + cluster.STARTUP_S)
    assert cluster.train_time_limit_s(job, candidate, 1000.0, 600.0) == 600.0
    assert cluster.train_minutes(job, candidate, 1000.0, None) == 38  # 2250 s, rounded up
    assert cluster.train_minutes(_slurm_job(time_limit="fixed", time_min=45), candidate, 1000.0, None) == 45
    assert cluster.train_minutes(job, candidate, None, None) == job.resources.time_min
    local = job.updated(launcher="local")
    assert cluster.train_minutes(local, candidate, 1000.0, None) == job.resources.time_min


def test_the_train_wall_time_counts_what_each_epochs_end_does_outside_the_epochs(monkeypatch):
    """Validation, the checkpoint and the strategy's epoch end run every epoch, outside the predicted epochs' time."""
    from tula_hpc.core.records import Selection
    from tula_hpc.stages.select import predicted_run

    job = _slurm_job(time_margin=0.5)
    candidate = {"time_s": 1000.0, "cost": 1.0, "rel_uncertainty": 0.1, "outside_epoch_s": 5.0}
    run = predicted_run(job, candidate)
    assert run["job_time_s"] == pytest.approx(1000 + 10 * 5.0) and run["time_s"] == 1000.0
    # (1050 x 1.2 + one epoch of 100 s and its end of 5 s) x 1.5 + the start-up
    limit = (1050 * 1.2 + 105) * 1.5 + cluster.STARTUP_S
    assert cluster.train_time_limit_s(job, candidate, run["job_time_s"], None) == pytest.approx(limit)
    selection = dataclasses.replace(Selection.by_hand(job, candidate), predicted=run)
    monkeypatch.setattr(cluster, "max_time_s", lambda job: None)  # the partition's MaxTime: unlimited
    assert cluster.train_job_minutes(job, selection) == math.ceil(limit / 60)


def test_queue_waits_ask_once_per_distinct_request(monkeypatch):
    asked = []
    soon = (dt.datetime.now() + dt.timedelta(hours=1)).isoformat(timespec="seconds")

    def fake(cmd):
        if cmd[:2] == ["scontrol", "show"]:
            return subprocess.CompletedProcess(cmd, 0, PARTITIONS, "")
        asked.append(cmd)
        start = soon if "--nodes=4" in cmd else "2000-01-01T00:00:00"  # in the past: starts now
        return subprocess.CompletedProcess(cmd, 0, "", f"sbatch: Job 9 to start at {start} using 8 processors on")

    monkeypatch.setattr(cluster, "_slurm", fake)
    job = _slurm_job(gpus_per_node=4)
    candidates = [{"nodes": n, "gpus_per_node": 4, "time_s": 100.0} for n in (1, 1, 4)]
    waits = cluster.queue_waits(job, candidates, [100.0, 100.0, 100.0])
    assert waits[:2] == [0.0, 0.0] and waits[2] == pytest.approx(3600, abs=5)
    assert len(asked) == 2 and all("--gpus-per-node=4" in cmd for cmd in asked)
    asked.clear()
    typed = job.updated(resources={"slurm": {"gpu_type": "h100"}})
    cluster.queue_waits(typed, [{"nodes": 1, "gpus_per_node": 2, "time_s": 100.0}], [100.0])
    assert "--gpus-per-node=h100:2" in asked[0] and "--ntasks-per-node" in asked[0]


# scontrol that fails its first `show` with the controller away, then prints the partitions; `ping` answers
# whatever the file `up` says (Slurm's own messages).
FLAKY_SCONTROL = """
if [ "$1" = ping ]; then
  if [ -e {up} ]; then echo 'Slurmctld(primary) at head is UP'; exit 0; fi
  echo 'Slurmctld(primary) at head is DOWN'; exit 1
fi
if [ ! -e {shown} ]; then
  touch {shown}; echo 'slurm_load_partitions error: Unable to contact slurm controller (connect failure)' >&2; exit 1
fi
cat {partitions}
"""


@pytest.fixture
def flaky_scontrol(tmp_path, monkeypatch):
    (tmp_path / "partitions").write_text(PARTITIONS)
    body = FLAKY_SCONTROL.format(up=tmp_path / "up", shown=tmp_path / "shown", partitions=tmp_path / "partitions")
    log = fake_commands(tmp_path, monkeypatch, scontrol=body)
    monkeypatch.setattr(cluster, "CONTROLLER_POLL_S", 0.01)
    return tmp_path, log


@pytest.mark.spawns
def test_a_command_that_fails_while_slurmctld_is_away_is_tried_again(flaky_scontrol):
    _, log = flaky_scontrol
    assert cluster.partition_limits(None).partition == "gpu"
    assert log.read_text().splitlines() == ["scontrol show partition -o", "scontrol ping", "scontrol show partition -o"]


@pytest.mark.spawns
def test_a_command_that_fails_while_slurmctld_answers_fails_at_once(flaky_scontrol):
    folder, log = flaky_scontrol
    (folder / "up").touch()
    with pytest.raises(cluster.ClusterError, match="Unable to contact slurm controller"):
        cluster.partition_limits(None)
    assert log.read_text().splitlines() == ["scontrol show partition -o", "scontrol ping"]


@pytest.mark.spawns
def test_a_controller_away_too_long_is_an_error_naming_the_command(flaky_scontrol, monkeypatch):
    monkeypatch.setattr(cluster, "CONTROLLER_PATIENCE_S", -1)
    with pytest.raises(cluster.ClusterError, match=r"`scontrol show partition -o` failed \(1\)"):
        cluster.partition_limits(None)

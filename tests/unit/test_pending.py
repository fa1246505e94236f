"""pending: squeue's pending reasons sorted into those that clear (printed while the job waits), the holds (only the
project's own requeue hold is replaced) and those no wait clears (the job is cancelled, the stage fails).

No cluster: fake `squeue` and `scancel` on PATH stand in for Slurm.
"""

from __future__ import annotations

import pytest

from tests.conftest import fake_commands
from tula_hpc.cluster import pending


@pytest.mark.parametrize(
    ("reason", "change"),
    [
        ("Priority", None),
        ("Resources", None),
        ("Dependency", None),
        ("JobHeldAdmin", None),
        ("PartitionTimeLimit", "resources.time_min"),
        ("PartitionNodeLimit", "search.nodes.max"),
        ("InvalidQOS", "resources.slurm.qos"),
        ("QOSMaxGRESPerJob", "fewer GPUs"),
        ("QOSMaxWallDurationPerJobLimit", "a shorter time"),
        ("AssocMaxNodesPerJobLimit", "fewer nodes"),
        ("QOSMaxGRESPerUser", "fewer GPUs"),  # an own limit: it never clears only while no other own job runs
        ("AssocGrpNodeLimit", "fewer nodes"),
    ],
)
def test_the_reasons_no_wait_clears_name_what_to_change(reason, change):
    found = pending.what_to_change(reason)
    assert found is None if change is None else change in found


@pytest.mark.spawns
def test_a_reason_that_clears_is_printed_once_and_again_when_it_changes(tmp_path, monkeypatch, capsys):
    reason = tmp_path / "reason"
    log = fake_commands(tmp_path, monkeypatch, squeue=f"cat {reason}", scancel="exit 0")
    watch = pending.PendingWatch("88", "train")
    for said in ("Priority", "Priority", "JobHeldAdmin", "JobHeldAdmin", "Resources"):
        reason.write_text(said)
        assert not watch.requeue_held()
    printed = capsys.readouterr().out.splitlines()
    assert printed == [
        "[tula-hpc] slurm job 88 (train) pends: Priority",
        "[tula-hpc] slurm job 88 (train) pends: JobHeldAdmin (held by an administrator: it waits until one "
        "releases it)",
        "[tula-hpc] slurm job 88 (train) pends: Resources",
    ]
    assert "scancel" not in log.read_text()


@pytest.mark.parametrize(("others", "cancelled"), [("88\n91", False), ("88", True)])
@pytest.mark.spawns
def test_an_own_limit_fails_the_stage_only_where_no_other_own_job_runs_to_free_it(
    tmp_path, monkeypatch, others, cancelled
):
    log = fake_commands(
        tmp_path,
        monkeypatch,
        squeue=f'case "$*" in *--me*) printf "{others}";; *) echo QOSMaxGRESPerUser;; esac',
        scancel="exit 0",
    )
    watch = pending.PendingWatch("88", "train")
    if cancelled:
        with pytest.raises(pending.PendingForever, match=r"QOSMaxGRESPerUser.*no other job of yours.*fewer GPUs"):
            watch.requeue_held()
    else:
        assert not watch.requeue_held()
    assert ("scancel 88" in log.read_text()) == cancelled


@pytest.mark.spawns
def test_the_projects_own_requeue_hold_is_told_apart(tmp_path, monkeypatch):
    fake_commands(tmp_path, monkeypatch, squeue="echo 'launch failed requeued held'")
    assert pending.PendingWatch("88", "train").requeue_held()

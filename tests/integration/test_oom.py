"""Out of memory for real: the device budget, the job step ending at once, and the relaunch that keeps the batch."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch
import yaml

import tula_hpc.training.validation as validation_module
from tests.conftest import REPO, tiny_job_config
from tests.integration.workers import NEVER_NOTICES_S, train_beside_a_rank_that_never_notices
from tula_hpc.cluster import launch
from tula_hpc.cluster.job_step_failures import failure_records
from tula_hpc.config import job_settings, load_config
from tula_hpc.core.job import Job
from tula_hpc.core.records import Selection
from tula_hpc.stages.train import train
from tula_hpc.training.trainer import train_worker

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# The tiny CNN's step on 8x8 digits needs about 2.4 MB + 58 kB per sample on each of 2 ranks (memory.json):
# 12 MB hold 128 samples at once, not 256.
TIGHT_GB = 0.012


def _job(tmp_path, **resources) -> Job:
    config = tiny_job_config()
    job = config["jobs"]["digits-cnn"]
    job["train"].update(epochs=3, lr_milestones=[])
    job["resources"].update(resources)
    (tmp_path / "jobs.yaml").write_text(yaml.safe_dump(config))
    return job_settings(load_config([tmp_path / "jobs.yaml"]), "digits-cnn")


def _checkpoint_at_epoch_1(job: Job, batch: int, stage_dir, monkeypatch) -> None:
    """A run of the same selection that died in its second epoch, with a budget it fitted in."""
    evaluate, calls = validation_module.evaluate_metrics, []

    def lose_the_node_in_epoch_2(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("node lost")
        return evaluate(*args, **kwargs)

    roomy = job.updated(resources={"device_memory_gb": 1})
    monkeypatch.setattr(validation_module, "evaluate_metrics", lose_the_node_in_epoch_2)
    with pytest.raises(RuntimeError, match="node lost"):
        train_worker(
            roomy,
            batch,
            str(stage_dir / "checkpoint.pt"),
            str(stage_dir / "model.pt"),
            str(stage_dir / "metrics.jsonl"),
            loop_log_path=str(stage_dir / "loop_time.jsonl"),
        )
    monkeypatch.undo()


def test_out_of_memory_relaunches_with_the_same_global_batch_from_the_checkpoint(tmp_path, monkeypatch):
    job = _job(tmp_path, device_memory_gb=TIGHT_GB)
    work = tmp_path / "work"
    _checkpoint_at_epoch_1(job, 512, work / "train", monkeypatch)
    Selection.by_hand(job, {"nodes": 2, "batch": 512}).write(tmp_path / "selection.json")

    summary = train(job, tmp_path / "selection.json", tmp_path / "summary.json", tmp_path / "model.pt", work).as_dict()

    attempts = summary["attempts"]
    assert attempts[0] == {
        "global_batch": 512,
        "per_device_batch": 256,
        "accumulation": 1,
        "micro_batch": 256,
        "outcome": "out_of_memory",
        "rank": attempts[0]["rank"],
        "error": attempts[0]["error"],
        "noticed_after_s": attempts[0]["noticed_after_s"],
    }
    assert attempts[0]["noticed_after_s"] < 5
    assert "can't allocate memory" in attempts[0]["error"]
    assert attempts[-1]["outcome"] == "completed" and all(a["global_batch"] == 512 for a in attempts)
    assert [a["accumulation"] for a in attempts] == [2**i for i in range(len(attempts))]
    assert summary["global_batch"] == 512 and summary["accumulation"] == attempts[-1]["accumulation"]
    assert summary["steps_per_epoch"] == 3 and summary["steps"] == 9
    assert summary["resumed_from_epoch"] == 1 and [h["epoch"] for h in summary["history"]] == [1, 2, 3]
    assert torch.load(work / "train" / "checkpoint.pt", weights_only=False)["state"]["epoch"] == 3
    assert json.loads((work / "train" / "attempts.json").read_text())["attempts"] == attempts
    # The epoch lost to the dead node and the steps lost to running out of memory cost time the kept epochs
    # (what the performance model predicts) do not show.
    assert summary["train_time_with_lost_work_s"] > summary["train_time_s"] > 0


def test_shrinking_the_global_batch_instead_is_a_choice(tmp_path):
    job = _job(tmp_path, device_memory_gb=TIGHT_GB, on_oom="shrink_global_batch")
    Selection.by_hand(job, {"nodes": 2, "batch": 512}).write(tmp_path / "selection.json")
    summary = train(
        job, tmp_path / "selection.json", tmp_path / "summary.json", tmp_path / "model.pt", tmp_path / "work"
    ).as_dict()
    assert [a["global_batch"] for a in summary["attempts"]][:2] == [512, 256]
    assert {a["accumulation"] for a in summary["attempts"]} == {1}
    assert summary["global_batch"] == summary["attempts"][-1]["global_batch"] < 512


def test_an_adaptive_batch_schedule_relaunches_with_smaller_slices_of_its_batch(tmp_path):
    """Under train.batch_schedule adaptive the schedule owns the global batch: running out of memory halves the slice
    a device computes at once (shrink_global_batch notwithstanding), and the schedule's batch trains on in slices."""
    from tests.unit.test_batch_schedule import rows

    job = _job(tmp_path, device_memory_gb=TIGHT_GB, on_oom="shrink_global_batch")
    job = job.updated(train={"batch_schedule": "adaptive", "strategy": "lbt"})
    Selection.by_hand(job, {"nodes": 2, "batch": 512}).write(tmp_path / "selection.json")
    perfmodel = tmp_path / "perfmodel.json"
    only_512 = [r for r in rows(nodes=2) if r["batch"] == 512]  # the goodput choice at any noise scale
    perfmodel.write_text(json.dumps({"train_samples": 1000, "candidates": only_512}))

    summary = train(
        job, tmp_path / "selection.json", tmp_path / "summary.json", tmp_path / "model.pt", tmp_path / "work", perfmodel
    ).as_dict()

    attempts = summary["attempts"]
    assert attempts[0]["outcome"] == "out_of_memory" and attempts[-1]["outcome"] == "completed"
    assert all(a["global_batch"] == 512 for a in attempts)
    assert [a["micro_batch"] for a in attempts] == [256 // 2**i for i in range(len(attempts))]
    assert summary["global_batch"] == 512 and summary["accumulation"] == attempts[-1]["accumulation"] > 1
    decisions = [h["batch_schedule"]["next"]["global_batch"] for h in summary["history"] if "batch_schedule" in h]
    assert len(decisions) > summary["epochs"] and set(decisions) == {512}  # every 20th of the run and epochs' ends


def out_of_memory_beside_a_rank_that_never_notices(job: Job, spec: launch.LaunchSpec, folder) -> tuple[dict, float]:
    """Rank 1 runs out of memory for real while rank 0 waits as NCCL's ranks do (forever): the job must fail.
    Returns rank 1's record and when the stage knew the job had ended."""
    with pytest.raises(launch.JobFailed):
        launch.run(
            train_beside_a_rank_that_never_notices,
            dict(
                budgets_gb=[1, TIGHT_GB],
                job=job,
                global_batch=512,
                checkpoint_path=str(folder / "checkpoint.pt"),
                model_path=str(folder / "model.pt"),
                metrics_path=str(folder / "metrics.jsonl"),
                failure_dir=str(folder / "failures"),
            ),
            spec,
            folder / "stage",
            name=f"{job.name}-oom",
        )
    noticed = time.time()
    [record] = failure_records(folder / "failures")
    assert record["outcome"] == "out_of_memory" and record["rank"] == 1
    return record, noticed


def test_a_rank_out_of_memory_ends_the_job_step_at_once_though_its_peer_never_notices(tmp_path):
    """The OOM agreement asks nothing of the backend: the rank that ran out of memory records it and exits; the
    launcher ends rank 0, and the record says what happened."""
    started = time.monotonic()
    record, noticed = out_of_memory_beside_a_rank_that_never_notices(
        _job(tmp_path), launch.LaunchSpec(launcher="local", nodes=2), tmp_path
    )
    print(f"the stage knew {noticed - record['recorded_at']:.2f} s after rank 1 recorded running out of memory")
    assert noticed - record["recorded_at"] < 5  # the launcher polls every 0.1 s; rank 0 alone would sleep 600 s
    assert time.monotonic() - started < NEVER_NOTICES_S / 2


def test_a_budget_too_small_for_the_model_fails_the_stage_naming_job_and_bytes(tmp_path):
    _job(tmp_path, device_memory_gb=0.0001)
    out = tmp_path / "memory.json"
    out.write_text("{}")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tula_hpc.stages.probe_memory",
            "--config",
            str(tmp_path / "jobs.yaml"),
            "--job",
            "digits-cnn",
            "--launcher",
            "local",
            "--work-dir",
            str(tmp_path / "work"),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert proc.returncode == 2
    assert (
        "job 'digits-cnn': field 'resources.device_memory_gb': a budget of 100,000 bytes cannot hold tiny_cnn at "
        "all: the model alone needs 605,224 bytes"
    ) in proc.stderr
    assert out.read_text() == "{}"

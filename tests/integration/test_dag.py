"""The real DAG on the tiny default job, through the local profile: files, accuracy, no-op rerun, resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
import yaml

from tests.conftest import default_job, snakemake_command, tiny_job_config

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
DESIGN_OUTPUTS = [
    "memory.json",
    "plan.json",
    "perfmodel.json",
    "selection.json",
    "train/summary.json",
    "train/model.pt",
    "eval.json",
    "report.md",
    "time_vs_batch.png",
    "cost_surface.png",
    "predicted_vs_measured.png",
    "training.png",
]


def snakemake(workdir: Path, *extra: str, **kwargs) -> subprocess.CompletedProcess | subprocess.Popen:
    cmd = snakemake_command(workdir, "local", workdir / "jobs.yaml", *extra)
    if kwargs.pop("background", False):
        return subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
    return subprocess.run(cmd, capture_output=True, text=True, **kwargs)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    config = tiny_job_config()
    workdir = tmp_path_factory.mktemp("dag")
    (workdir / "jobs.yaml").write_text(yaml.safe_dump(config))
    started = time.perf_counter()
    proc = snakemake(workdir)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return workdir, time.perf_counter() - started


def test_dag_writes_every_stage_output_and_trains_an_accurate_model(finished_run):
    workdir, _ = finished_run
    results = workdir / "results" / "digits-cnn"
    for name in DESIGN_OUTPUTS:
        assert (results / name).stat().st_size > 0, name
    plan = json.loads((results / "plan.json").read_text())
    profiles = [f"profile/N{c['nodes']}_B{c['batch']}.json" for c in plan["profile"]]
    # Every stage writes exactly its declared outputs (and its own files under work/, logs under logs/).
    written = {str(p.relative_to(results)) for p in results.rglob("*") if p.is_file()}
    # Partial search confirms its choice (search.confirm): the profiles it added are adaptive.json's.
    assert written == set(DESIGN_OUTPUTS) | set(profiles) | {"adaptive.json"}
    assert {p.name for p in workdir.iterdir()} <= {"jobs.yaml", "results", "work", "logs", ".snakemake"}
    assert plan["mode"] == "partial" and len(plan["profile"]) < len(plan["candidates"])
    selection = json.loads((results / "selection.json").read_text())
    chosen = selection["chosen"]
    assert (chosen["nodes"], chosen["batch"]) in {(c["nodes"], c["batch"]) for c in plan["candidates"]}
    assert set(selection["knees"]) == {"kneedle", "model"} and selection["runners_up"]
    assert all(r["time_s"] > 0 and r["cost"] > 0 for r in selection["runners_up"])
    perfmodel = json.loads((results / "perfmodel.json").read_text())
    confirm = perfmodel["search"]["confirm"]
    limit = default_job().search.confirm  # config/jobs.yaml's
    assert confirm["limit"] == limit and len(confirm["profiles"]) <= limit
    assert confirm["objective"] == selection["objective"]
    assert len(perfmodel["profiled"]) == len(plan["profile"]) + len(confirm["profiles"])
    if not confirm["stopped"].startswith("reached search.confirm"):  # it measured every configuration that could win
        assert (chosen["nodes"], chosen["batch"]) in {(p["nodes"], p["batch"]) for p in perfmodel["profiled"]}
    assert 0 < perfmodel["search"]["price"]["share"] <= 1.5  # profiles of a few steps; every candidate is ~1
    # N in {1, 2} on one host: one multi-rank size, so the intra-node latency comes from the prior.
    assert perfmodel["identified"]["intra_node_latency_s"] is False
    # One core a rank (resources.cpus_per_task): no loader worker, so no loader pace holds a step.
    assert perfmodel["loader_rate"]["workers"] == 0 and chosen["loader_s"] == 0 and not chosen["loader_bound"]
    for name in plan["profile"]:
        profile = json.loads((results / "profile" / f"N{name['nodes']}_B{name['batch']}.json").read_text())
        assert set(profile["median"]) == {"data_s", "compute_s", "sync_s", "update_s", "step_s"}
        assert 0 <= profile["interference"] <= 1 and profile["samples_per_s"] > 0 and profile["peak_rss_bytes"] > 0
    summary = json.loads((results / "train" / "summary.json").read_text())
    assert summary["global_batch"] == chosen["batch"] and summary["world_size"] == chosen["nodes"]
    assert summary["epochs"] == 12 and [h["epoch"] for h in summary["history"]] == list(range(1, 13))
    evaluation = json.loads((results / "eval.json").read_text())
    assert evaluation["test_accuracy"] >= 0.95
    assert evaluation["measured_train_time_s"] > 0 and evaluation["predicted_train_time_s"] > 0
    report = (results / "report.md").read_text()
    assert f"{chosen['nodes']} node(s), global batch {chosen['batch']}" in report
    assert "was confirmed before it committed" in report and "device-seconds" in report
    assert (results / "time_vs_batch.png").read_bytes()[:4] == b"\x89PNG"
    # Checkpoints live in the work folder, never among the results.
    checkpoint = torch.load(workdir / "work" / "digits-cnn" / "train" / "checkpoint.pt", weights_only=False)
    assert checkpoint["state"]["epoch"] == 12


def test_second_run_has_nothing_to_do(finished_run):
    workdir, _ = finished_run
    proc = snakemake(workdir)
    assert proc.returncode == 0
    assert "Nothing to be done" in proc.stdout + proc.stderr


def test_bad_config_fails_before_anything_runs_and_keeps_results(finished_run):
    workdir, _ = finished_run
    memory = workdir / "results" / "digits-cnn" / "memory.json"
    before = (memory.read_bytes(), memory.stat().st_mtime_ns)
    good = (workdir / "jobs.yaml").read_text()
    bad = yaml.safe_load(good)
    bad["jobs"]["digits-cnn"]["search"]["batch"] = {"min": 512, "max": 64}
    (workdir / "jobs.yaml").write_text(yaml.safe_dump(bad))
    try:
        proc = snakemake(workdir)
    finally:
        (workdir / "jobs.yaml").write_text(good)
    assert proc.returncode != 0
    assert "job 'digits-cnn': field 'search.batch': min (512) is larger than max (64)" in proc.stdout + proc.stderr
    assert (memory.read_bytes(), memory.stat().st_mtime_ns) == before


@pytest.mark.parametrize(
    "factory, message",
    [
        ("raises", "field 'model.name': 'tests.unit.factories:raises' raised RuntimeError"),
        ("not_a_module", "field 'model.name': 'tests.unit.factories:not_a_module' returned dict"),
        ("with_width", "field 'model.name': 'tests.unit.factories:with_width' requires argument 'width'"),
    ],
)
def test_a_bad_model_factory_fails_before_anything_runs_and_keeps_results(finished_run, factory, message):
    workdir, _ = finished_run
    results = workdir / "results" / "digits-cnn"
    before = {path: (path.read_bytes(), path.stat().st_mtime_ns) for path in results.rglob("*") if path.is_file()}
    good = (workdir / "jobs.yaml").read_text()
    bad = yaml.safe_load(good)
    bad["jobs"]["digits-cnn"]["model"] = {"name": f"tests.unit.factories:{factory}"}
    (workdir / "jobs.yaml").write_text(yaml.safe_dump(bad))
    try:
        proc = snakemake(workdir, cwd=REPO)  # where tests.unit.factories imports from
    finally:
        (workdir / "jobs.yaml").write_text(good)
    assert proc.returncode != 0
    assert f"job 'digits-cnn': {message}" in proc.stdout + proc.stderr
    after = {path: (path.read_bytes(), path.stat().st_mtime_ns) for path in results.rglob("*") if path.is_file()}
    assert after == before


def test_killed_run_resumes_training_from_its_last_checkpoint(finished_run):
    """Kill the driver and everything it started mid-training; the rerun resumes, not restarts."""
    workdir, _ = finished_run
    config = yaml.safe_load((workdir / "jobs.yaml").read_text())
    config["jobs"]["digits-cnn"]["train"]["epochs"] = 80  # a params change: train, evaluate, report rerun
    (workdir / "jobs.yaml").write_text(yaml.safe_dump(config))
    checkpoint = workdir / "work" / "digits-cnn" / "train" / "checkpoint.pt"
    proc = snakemake(workdir, background=True)
    deadline = time.time() + 240
    killed_at = None
    while time.time() < deadline and proc.poll() is None:
        if checkpoint.exists():
            state = torch.load(checkpoint, weights_only=False)
            if state["run"]["train"]["epochs"] == 80 and state["state"]["epoch"] >= 3:
                os.killpg(proc.pid, signal.SIGKILL)
                killed_at = state["state"]["epoch"]
                break
        time.sleep(0.2)
    proc.wait()
    assert killed_at is not None, "training finished or never started before it could be killed"
    rerun = snakemake(workdir)  # the same command: the lock the killed driver left is its to remove
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    summary = json.loads((workdir / "results" / "digits-cnn" / "train" / "summary.json").read_text())
    assert summary["resumed_from_epoch"] is not None and summary["resumed_from_epoch"] >= killed_at
    assert summary["epochs"] == 80 and summary["steps"] == 80 * summary["steps_per_epoch"]
    assert "resuming from checkpoint" in (workdir / "logs" / "digits-cnn" / "train.log").read_text()

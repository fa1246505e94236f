"""bench/gpu_check.py end to end on the CPU at its quick sizes: every section runs (the DAG too) and the result file
holds their figures and verdicts. The GPU's own figures come from `make gpu-check` on a GPU machine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
SECTIONS = {"memory", "training", "oom", "steptime", "dag"}


def test_every_section_runs_on_the_cpu_and_writes_its_figures(tmp_path):
    default_out = REPO / "bench" / "results" / "gpu_check.json"
    existed = default_out.exists()
    out = tmp_path / "gpu_check.json"
    cmd = [sys.executable, str(REPO / "bench" / "gpu_check.py"), "--device", "cpu", "--scale", "quick"]
    proc = subprocess.run(
        [*cmd, "--out", str(out), "--work-dir", str(tmp_path / "work")], capture_output=True, text=True, timeout=1500
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads(out.read_text())
    assert default_out.exists() == existed
    assert result["device"]["type"] == "cpu" and result["settings"]["scale"] == "quick"
    assert result["targets_judged"] is False  # figures of the CPU judge nothing
    assert {"git_commit", "source_digest", "torch"} <= set(result["provenance"])
    sections = result["sections"]
    assert set(sections) == SECTIONS
    assert not [name for name, section in sections.items() if "error" in section]
    assert all(section["section_seconds"] > 0 for section in sections.values())
    assert result["complete"] and all(section["stamp"] == sections["memory"]["stamp"] for section in sections.values())
    assert {"memory.median", "memory.max", "memory.median_reserved", "memory.max_reserved"} <= set(result["verdicts"])
    assert {"oom.relaunch_keeps_global_batch", "steptime.loo_median", "dag.completed"} <= set(result["verdicts"])

    [case] = sections["memory"]["cases"]
    assert len(case["trials"]) >= 3 and case["trials"][-1]["batch"] <= case["predicted_max_batch"]
    assert all(t["outcome"] == "fits" and t["batch"] > max(case["probe_batches"]) for t in case["trials"])
    # On the CPU the budget allocator's count is exact and every figure is one count.
    assert sections["memory"]["overall"]["allocated"]["max_rel_error"] < 0.01
    assert result["verdicts"]["memory.max"]["met"]

    # The memory stage's proposal, trained by the train stage's worker: it trains, and 5 % above trains or runs out.
    [case] = sections["training"]["cases"]
    assert (
        case["proposal"]["limited_by"] == "memory"
        and case["proposed"]["batch"] == case["proposal"]["max_batch_per_device"]
    )
    assert case["proposed"]["outcome"] == "completed" and case["above"]["batch"] >= 1.05 * case["proposed"]["batch"]
    assert case["above"]["outcome"] in ("completed", "out_of_memory")
    assert case["proposed"]["reserved"]["rel_error"] < 0.01  # the CPU's count is exact
    assert result["verdicts"]["training.proposed_trains"]["met"]

    oom = sections["oom"]
    assert oom["attempts"][0]["outcome"] == "out_of_memory" and oom["attempts"][-1]["outcome"] == "completed"
    assert {a["global_batch"] for a in oom["attempts"]} == {result["settings"]["preset"]["oom"]["batch"]}
    assert result["verdicts"]["oom.relaunch_keeps_global_batch"]["met"]

    steps = sections["steptime"]
    [case] = steps["cases"].values()
    assert case["rounds"] == 2 and set(case["per_batch"]) == {"16", "32", "64"}
    assert case["noise_floor"] is not None and steps["loo_median_rel_error"] == case["loo"]["median_rel_error"]
    assert len(steps["measurements"]) == 2 * 3
    trained = case["trained"]  # the train stage's epochs at a profiled batch against the predicted epoch
    assert trained["batch"] == 32 and len(trained["measured_epoch_s"]) == 2 and trained["predicted_epoch_s"] > 0
    assert "steptime.trained_epoch_median" in result["verdicts"]

    dag = sections["dag"]
    assert dag["returncode"] == 0 and result["verdicts"]["dag.completed"]["met"]
    assert dag["chosen"]["nodes"] == 1 and dag["test_accuracy"] > 0.5
    assert "auto" in dag["device_memory_source"]  # the batch sized from the device, not a fixed 1 GB
    [evaluation] = (tmp_path / "work").rglob("results/digits-cnn/eval.json")  # in the scratch folder, not in results/
    assert json.loads(evaluation.read_text())["test_accuracy"] == dag["test_accuracy"]

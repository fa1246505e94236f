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
SECTIONS = {"memory", "oom", "memory_imagenet", "steptime", "dag"}


def test_every_section_runs_on_the_cpu_and_writes_its_figures(tmp_path):
    default_out = REPO / "bench" / "results" / "gpu_check.json"
    cases_dir = REPO / "bench" / "data" / "gpu"
    recorded = set(cases_dir.rglob("*.json"))
    existed = default_out.exists()
    out = tmp_path / "gpu_check.json"
    cmd = [sys.executable, str(REPO / "bench" / "gpu_check.py"), "--device", "cpu", "--scale", "quick"]
    proc = subprocess.run(
        [*cmd, "--out", str(out), "--work-dir", str(tmp_path / "work"), "--copy-to", str(tmp_path / "back")],
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert proc.stdout.index("plan on cpu") < proc.stdout.index("== memory")
    result = json.loads(out.read_text())
    assert default_out.exists() == existed  # the CPU writes neither the GPU's results nor its recorded cases
    assert not set(cases_dir.rglob("*.json")) - recorded
    assert result["device"]["type"] == "cpu" and result["settings"]["scale"] == "quick"
    back = tmp_path / "back"  # a device call's return folder: the result and the cases, as they were written
    assert json.loads((back / out.name).read_text()) == result
    assert len(list(back.glob("*tiny_cnn*.json"))) == 2 and len(list((back / "whole_run").glob("*.json"))) == 1
    assert result["targets_judged"] is False  # figures of the CPU judge nothing
    assert {"git_commit", "source_digest", "torch"} <= set(result["provenance"])
    sections = result["sections"]
    assert set(sections) == SECTIONS and list(sections) == ["memory", "oom", "memory_imagenet", "steptime", "dag"]
    assert not [name for name, section in sections.items() if "error" in section or section.get("failed_cases")]
    assert all(result["seconds"][name] == section["section_seconds"] > 0 for name, section in sections.items())
    assert result["seconds"]["run"] >= sum(s["section_seconds"] for s in sections.values())
    assert result["complete"] and all(section["stamp"] == sections["memory"]["stamp"] for section in sections.values())
    assert {"memory.median", "memory.max", "memory.median_reserved", "memory.max_reserved"} <= set(result["verdicts"])
    assert {"memory.truth_bracketed", "memory.stage_vs_truth", "memory.both_ways_agree"} <= set(result["verdicts"])
    assert {"oom.relaunch_keeps_global_batch", "steptime.loo_median", "dag.completed"} <= set(result["verdicts"])

    # The truth bisected within 1 %, the stage's answer both ways, written as a replay case in the scratch folder.
    [case] = sections["memory"]["cases"]
    truth = case["truth"]
    assert truth["largest_fits"] < truth["smallest_fails"] and truth["bracketed_within"] <= 0.01
    assert {t["outcome"] for t in case["trials"]} == {"fits", "out_of_memory"}
    assert set(case["stage"]) == {"one_process", "fresh_processes"}
    assert all(s["answer"] < truth["smallest_fails"] and s["seconds"] > 0 for s in case["stage"].values())
    written = json.loads(Path(case["case_file"]).read_text())
    assert Path(case["case_file"]).parent == tmp_path / "work" / Path(case["case_file"]).parts[-3] / "cases"
    assert {"case", "recorded", "shape", "job", "memory", "trials", "truth", "seconds", "warmup"} <= set(written)
    assert written["recorded"]["device"]["type"] == "cpu"
    # On the CPU the budget allocator's count is exact and every figure is one count.
    assert case["model_errors"]["allocated"]["max_rel_error"] < 0.01 and result["verdicts"]["memory.max"]["met"]
    lightning = case["lightning"]  # not a dependency: where it is absent that part is skipped, not failed
    assert ("skipped" in lightning) == ("memory.stage_time_over_lightning" not in result["verdicts"])
    if "skipped" not in lightning:
        assert lightning["trials"] and lightning["seconds"] > 0

    oom = sections["oom"]
    assert oom["checks"]["first_attempt_real_out_of_memory"] and oom["attempts"][-1]["outcome"] == "completed"
    assert oom["budget_checks"][-1]["b=512"] == "out_of_memory" and oom["budget_checks"][-1]["b=256"] == "fits"
    assert {a["global_batch"] for a in oom["attempts"]} == {result["settings"]["preset"]["oom"]["batch"]}
    assert result["verdicts"]["oom.relaunch_keeps_global_batch"]["met"]

    steps = sections["steptime"]
    [case] = steps["cases"].values()
    assert case["rounds"] == 2 and set(case["per_batch"]) == {"16", "32", "64"}
    assert case["noise_floor"] is not None and steps["loo_median_rel_error"] == case["loo"]["median_rel_error"]
    assert len(steps["measurements"]) == 2 * 3
    trained = case["trained"]  # the train stage's epochs at a profiled batch against the predicted epoch
    assert trained["batch"] == 32 and len(trained["measured_epoch_s"]) == len(trained["predicted_epoch_s"]) == 3
    assert all(p > 0 for p in trained["predicted_epoch_s"]) and trained["first_epoch_rel_error"] is not None
    assert trained["steps_per_epoch"] >= 200 and list(trained["rel_errors"]) == ["epoch 1", "epoch 2", "epoch 3"]
    assert "steptime.trained_epoch_median" in result["verdicts"]
    # ... kept as a whole-run case in the scratch folder, which the replay predicts again as the section did.
    kept = Path(trained["case"])
    assert kept.parent == tmp_path / "work" / kept.parts[-4] / "cases" / "whole_run"
    replayed = tmp_path / "whole_run_replay.json"
    replay = [sys.executable, str(REPO / "bench" / "whole_run_replay.py"), "--cases", str(kept.parent)]
    proc = subprocess.run([*replay, "--out", str(replayed)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [row] = json.loads(replayed.read_text())["rows"]
    assert row["predicted"][0]["epoch_time_s"] == trained["measured_epoch_s"]
    assert row["predicted"][0]["predicted"]["epoch_time_s"] == pytest.approx(trained["predicted_epoch_s"], rel=0.1)

    dag = sections["dag"]
    assert dag["returncode"] == 0 and result["verdicts"]["dag.completed"]["met"] and dag["stopped_after_s"] is None
    assert dag["chosen"]["nodes"] == 1 and dag["test_accuracy"] > 0.5
    assert {"probe_memory", "plan", "profile", "fit_model", "select", "train", "evaluate", "report"} <= set(
        dag["stage_seconds"]
    )
    assert "auto" in dag["device_memory_source"]  # the batch sized from the device, not a fixed 1 GB
    [evaluation] = (tmp_path / "work").rglob("results/digits-cnn/eval.json")  # in the scratch folder, not in results/
    assert json.loads(evaluation.read_text())["test_accuracy"] == dag["test_accuracy"]

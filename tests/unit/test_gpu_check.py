"""bench/gpu_check.py (its sections, bench/gpu_memory.py and bench/gpu_steps.py, and its plan, bench/gpu_plan.py):
says so without a GPU and writes nothing; its plan fits the slot and orders sections by value; its verdicts, summaries
and the result file that accumulates sections across runs, on known numbers. The whole check on the CPU:
tests/integration/test_gpu_check.py."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from tula_bench import common, gpu_check, gpu_device, gpu_memory, gpu_plan, gpu_steps, gpu_truth

from tests.conftest import default_job

BENCH = Path(__file__).resolve().parents[2] / "bench"

DEFAULT_OUT = BENCH / "results" / "gpu_check.json"


def test_without_a_gpu_it_says_so_measures_nothing_writes_nothing_and_exits_0(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    existed = DEFAULT_OUT.exists()
    assert gpu_check.main([]) == 0
    assert gpu_check.main(["--out", str(tmp_path / "gpu_check.json")]) == 0
    out = capsys.readouterr().out
    assert out.count("gpu-check: no CUDA GPU found") == 2 and "nothing was measured" in out
    assert not (tmp_path / "gpu_check.json").exists() and DEFAULT_OUT.exists() == existed
    assert not any(tmp_path.iterdir())


def test_asking_for_cuda_without_a_gpu_is_an_error(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as stop:
        gpu_check.main(["--device", "cuda"])
    assert stop.value.code == 2 and "sees no CUDA GPU" in capsys.readouterr().err


def test_a_cpu_run_must_name_its_own_file(tmp_path, capsys):
    """The CPU run tests the check; it never writes the GPU's result file."""
    existed = DEFAULT_OUT.exists()
    with pytest.raises(SystemExit) as stop:
        gpu_check.main(["--device", "cpu", "--work-dir", str(tmp_path)])
    assert stop.value.code == 2 and "--out" in capsys.readouterr().err
    assert DEFAULT_OUT.exists() == existed and not any(tmp_path.iterdir())


@pytest.mark.spawns
def test_the_command_line_without_a_gpu_exits_0(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc = subprocess.run(
        [sys.executable, str(BENCH / "gpu_check.py"), "--out", str(tmp_path / "x.json")], capture_output=True, text=True
    )
    assert proc.returncode == 0 and proc.stdout.startswith("gpu-check: no CUDA GPU found")
    assert not (tmp_path / "x.json").exists()


@pytest.mark.parametrize(
    "figure, target, met", [(0.02, 0.03, True), (0.03, 0.03, True), (0.031, 0.03, False), (None, 0.03, False)]
)
def test_a_verdict_is_met_or_not_with_its_figure(figure, target, met):
    assert common.verdict(figure, target) == {"met": met, "figure": figure, "target": target}


def test_a_verdict_on_numpy_figures_is_plain_json():
    found = common.verdict(np.float64(0.01), 0.02)
    assert type(found["met"]) is bool and type(found["figure"]) is float
    json.dumps(found)


def test_error_summary_takes_magnitudes_and_names_the_worst():
    summary = common.error_summary({"b=512": 0.01, "b=1024": -0.05, "b=2048": 0.02})
    assert summary == {"count": 3, "median_rel_error": 0.02, "max_rel_error": 0.05, "worst": "b=1024"}
    assert common.error_summary({}) == {"count": 0, "median_rel_error": None, "max_rel_error": None, "worst": None}


def test_all_verdicts_name_their_section():
    sections = {"memory": {"verdicts": {"median": {"met": True}}}, "dag": {"error": "x"}}
    assert gpu_check.all_verdicts(sections) == {"memory.median": {"met": True}}


def test_the_index_cap_keeps_every_activation_below_2_to_the_31_elements():
    job = default_job(model={"name": "tiny_cnn"}, data={"image_size": 32})
    # tiny_cnn's largest output is its second convolution's, 64 x 32 x 32 per image.
    assert gpu_truth.index_cap(job, SimpleNamespace(shape={"num_classes": 10, "in_channels": 1, "image_size": 32})) == (
        2**31 - 1
    ) // (64 * 32 * 32)


def _profile(round_: int, batch: int, scale: float = 1.0, interference: float = 0.0) -> dict:
    """A profile record of one rank whose parts are exact lines in the batch, times `scale`."""
    data, compute, update = 1e-4 + 2e-6 * batch, 2e-3 + 5e-5 * batch, 5e-4
    median = {"data_s": data, "compute_s": compute, "sync_s": 0.0, "update_s": update}
    median = {k: v * scale for k, v in median.items()}
    median["step_s"] = median["data_s"] + median["compute_s"] + median["update_s"]
    return {
        "round": round_,
        "per_device_batch": batch,
        "world_size": 1,
        "ranks_per_host": 1,
        "grad_bytes": 4e6,
        "interference": interference,
        "median": median,
    }


SETTINGS = {
    "collective": "ring",
    "sync_prior": {
        "intra_node": {"latency_s": 5e-5, "bandwidth_gb_s": 1},
        "inter_node": {"latency_s": 1e-4, "bandwidth_gb_s": 1},
    },
    "noise_prior": 0.03,
    "discrepancy_per_octave": 0.02,
    "interference_tolerance": 0.1,
}
BATCHES = (16, 32, 64, 128)


def test_steps_on_exact_lines_repeated_alike_have_no_noise_and_no_leave_one_out_error():
    records = [_profile(r, b) for r in range(3) for b in BATCHES]
    figures = gpu_steps.step_time_figures(records, SETTINGS)
    assert figures["noise_floor"] == 0.0 and figures["rounds"] == 3
    assert figures["loo"]["count"] == 3 * len(BATCHES) and figures["loo"]["max_rel_error"] < 1e-3
    assert set(figures["per_batch"]) == {str(b) for b in BATCHES}


def test_noise_and_leave_one_out_error_are_judged_against_the_other_rounds():
    """As bench/perf_accuracy.py: truth is the median of the other rounds, of their quiet ones when there are any."""
    records = [_profile(0, b) for b in BATCHES] + [_profile(1, b, scale=1.1) for b in BATCHES]
    records += [_profile(2, b, scale=5.0, interference=0.5) for b in BATCHES]  # disturbed: never the truth
    figures = gpu_steps.step_time_figures(records, SETTINGS)
    # Round 0 against round 1 (1.1x): 1/1.1 - 1; round 1 against round 0: +10 %; round 2 against both: 5/1.05 - 1.
    assert figures["noise_floor"] == pytest.approx(0.1)
    assert figures["noise_max"] == pytest.approx(5 / 1.05 - 1)
    assert figures["per_batch"]["16"]["loo_rel_error"] == pytest.approx(0.1, abs=1e-3)


STAMP = {"device": "NVIDIA H100 80GB HBM3", "torch": "2.11.0", "git_commit": "f00d", "source_digest": "abc"}


def test_an_earlier_section_of_other_code_device_torch_or_scale_is_kept_marked_stale(tmp_path):
    path = tmp_path / "gpu_check.json"
    now = {**STAMP, "scale": "gpu"}
    sections = {
        "memory": {"m": 1, "stamp": now},
        "dag": {"d": 1, "stamp": {**now, "source_digest": "old"}, "stale": {"torch": "an older mark, replaced"}},
        "steptime": {"s": 1, "stamp": {**now, "git_commit": "beef"}},  # the commit alone is stamped, not compared
        "gone": {"g": 1, "stamp": now},  # a section this code no longer has
    }
    path.write_text(json.dumps({"sections": sections}))
    kept = gpu_check.earlier_sections(path, now)
    assert kept["memory"] == sections["memory"] and kept["steptime"] == sections["steptime"] and "gone" not in kept
    assert kept["dag"]["stale"] == {"source_digest": {"then": "old", "now": "abc"}} and kept["dag"]["d"] == 1
    other = gpu_check.earlier_sections(path, {**now, "device": "NVIDIA H200", "scale": "quick"})
    assert set(other["memory"]["stale"]) == {"device", "scale"}
    assert gpu_check.earlier_sections(tmp_path / "none.json", now) == {}


def test_only_fresh_sections_judge_and_the_check_is_complete_when_every_section_is_fresh():
    info, found = {"name": STAMP["device"], "type": "cuda", "torch": STAMP["torch"]}, {"source_digest": "abc"}
    fresh = {name: {"verdicts": {"ok": {"met": True}}} for name in gpu_check.SECTIONS}
    run = {"plan": dict.fromkeys(gpu_check.SECTIONS, 1), "skipped": {}, "finished": [], "seconds": 500.0}
    for name in gpu_check.SECTIONS:  # the slot is judged once the last section has ended, not after each before it
        assert "check.within_slot" not in gpu_check.result_document(fresh, info, found, "gpu", run)["verdicts"]
        run["finished"].append(name)
    document = gpu_check.result_document(fresh, info, found, "gpu", run)
    assert document["complete"] and document["all_met"] and document["targets_judged"]
    assert document["verdicts"]["check.within_slot"] == {"met": True, "figure": 500.0, "target": 540}
    assert document["seconds"]["run"] == 500.0
    assert list(document["sections"]) == list(gpu_check.SECTIONS)
    stale = {**fresh, "dag": {"verdicts": {"ok": {"met": True}}, "stale": {"source_digest": {}}}}
    document = gpu_check.result_document(stale, info, found, "gpu", run)
    assert "dag.ok" not in document["verdicts"] and document["missing_or_stale"] == ["dag"]
    assert not document["complete"] and not document["all_met"]


@pytest.mark.spawns
def test_sections_run_apart_accumulate_in_one_file_each_stamped(tmp_path, monkeypatch):
    """A check split over device calls: --sections memory, then --sections steptime, leave both in the file."""
    for name in gpu_check.SECTIONS:
        monkeypatch.setitem(
            gpu_check.SECTIONS, name, lambda device, preset, scratch, context, name=name: {"figure": name}
        )
    out, work = tmp_path / "gpu_check.json", tmp_path / "work"
    for name in ("memory", "steptime"):
        assert gpu_check.main(["--device", "cpu", "--out", str(out), "--work-dir", str(work), "--sections", name]) == 0
    result = json.loads(out.read_text())
    assert list(result["sections"]) == ["memory", "steptime"]
    assert {s["figure"] for s in result["sections"].values()} == {"memory", "steptime"}
    for section in result["sections"].values():
        assert set(section["stamp"]) == {"device", "torch", "git_commit", "source_digest", "scale"}
        assert section["stamp"]["torch"] == torch.__version__ and "stale" not in section
    assert not result["complete"] and set(result["missing_or_stale"]) == {"oom", "memory_imagenet", "dag"}


def test_error_summary_leaves_out_what_was_not_measured():
    assert common.error_summary({"a": 0.1, "b": None})["count"] == 1


def test_without_git_the_commit_comes_from_the_caller_and_the_digest_names_the_code(monkeypatch):
    def no_git(*args):
        raise subprocess.CalledProcessError(128, ["git", *args])

    monkeypatch.setattr(common, "_git", no_git)
    monkeypatch.setenv("TULA_GIT_COMMIT", "f00d")
    found = gpu_device.provenance_here()
    assert found["git_commit"] == "f00d" and found["git_dirty"] is None
    assert found["source_digest"] == gpu_device.source_digest() and len(found["source_digest"]) == 16
    assert {"processor", "python", "torch", "written_at"} <= set(found)
    monkeypatch.delenv("TULA_GIT_COMMIT")
    unnamed = gpu_device.provenance_here()
    assert unnamed["git_commit"] is None and unnamed["source_digest"] == found["source_digest"]


@pytest.mark.spawns
def test_the_callers_commit_wins_over_git_even_inside_a_git_repository(monkeypatch):
    """A copy inside another repository's work tree got that repository's commit from git, the caller's ignored."""
    monkeypatch.delenv("TULA_GIT_COMMIT", raising=False)
    from_git = gpu_device.provenance_here()["git_commit"]
    assert from_git == common._git("rev-parse", "HEAD")
    monkeypatch.setenv("TULA_GIT_COMMIT", "f00d")
    found = gpu_device.provenance_here()
    assert found["git_commit"] == "f00d" != from_git and found["git_dirty"] is None


# --- the plan ---------------------------------------------------------------------------------------------------


def test_the_default_preset_is_planned_whole_within_the_slot_in_order_of_value():
    rows = gpu_plan.plan(gpu_plan.PRESETS["gpu"], "cuda", list(gpu_check.SECTIONS), None)
    assert [r["section"] for r in rows] == list(gpu_plan.VALUE) == list(gpu_check.SECTIONS)
    assert all(r["runs"] for r in rows) and all(r["estimate_s"] > 0 for r in rows)
    assert sum(r["estimate_s"] for r in rows) <= gpu_plan.SLOT_S
    assert [r["starts_at_s"] for r in rows] == sorted(r["starts_at_s"] for r in rows)


def test_a_short_budget_keeps_the_most_valuable_sections_and_skips_what_does_not_fit():
    rows = gpu_plan.plan(gpu_plan.PRESETS["gpu"], "cuda", list(gpu_check.SECTIONS), 280)
    runs = [r["section"] for r in rows if r["runs"]]
    assert runs[:2] == ["memory", "oom"] and "dag" not in runs
    assert sum(r["estimate_s"] for r in rows if r["runs"]) <= 280
    text = gpu_plan.plan_text(rows, "cuda", 280)
    assert "skipped: does not fit the budget" in text and "of --budget-s 280" in text
    # A section asked for alone is planned alone; one that fits nothing is skipped.
    assert [r["section"] for r in gpu_plan.plan(gpu_plan.PRESETS["gpu"], "cuda", ["dag"], None)] == ["dag"]
    assert not any(r["runs"] for r in gpu_plan.plan(gpu_plan.PRESETS["gpu"], "cuda", ["dag"], 10))


def test_estimates_scale_with_the_presets_size_from_recorded_figures():
    preset = gpu_plan.PRESETS["gpu"]
    figures = gpu_plan.FIGURES["cuda"]
    one = {**preset["memory"], "cases": {"a": {"model": "resnet18"}}}
    both = {**one, "cases": {"a": {"model": "resnet18", "lightning": True, "stage": ["one_process"]}}}
    assert gpu_plan.memory_estimate(one, figures) == figures["truth_s"]["resnet18"]
    assert gpu_plan.memory_estimate(both, figures) == (
        figures["truth_s"]["resnet18"] + figures["lightning_s"]["resnet18"] + figures["stage_s"]["one_process"]
    )
    # A model never recorded is estimated long, not short.
    assert gpu_plan.memory_estimate({"cases": {"a": {"model": "new"}}}, figures) == max(figures["truth_s"].values())
    longer = {**preset["steptime"], "rounds": 2 * preset["steptime"]["rounds"]}
    assert gpu_plan.steptime_estimate(longer, figures) > gpu_plan.steptime_estimate(preset["steptime"], figures)
    # A measurement's steps cost what a step costs at its batch: doubled batches past the launch-bound ones, longer.
    doubled = [{**c, "batch": {k: 2 * v for k, v in c["batch"].items()}} for c in preset["steptime"]["cases"]]
    larger = {**preset["steptime"], "cases": doubled}
    assert gpu_plan.steptime_estimate(larger, figures) > gpu_plan.steptime_estimate(preset["steptime"], figures)
    for device in ("cuda", "cpu"):  # every figure says where it came from
        sources = {"truth_source", "lightning_source", "stage_source", "steps_source", "dag_source"}
        assert sources | {"measurement_source"} <= set(gpu_plan.FIGURES[device])


def test_every_trained_epoch_of_the_default_preset_has_200_steps():
    for case in gpu_plan.PRESETS["gpu"]["steptime"]["cases"]:
        batch = gpu_plan.middle(case["batch"]["min"], case["batch"]["max"])
        assert int(gpu_memory.synthetic_size(batch) * 0.7) // batch >= gpu_plan.STEPS_PER_EPOCH
    assert gpu_plan.middle(16, 64) == 32 and gpu_plan.middle(64, 64) == 64 and gpu_plan.middle(16, 128) == 64
    assert gpu_plan.PRESETS["gpu"]["steptime"]["epochs_trained"] >= gpu_steps.STEADY_FROM


def test_the_plan_alone_is_printed_without_a_gpu(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--plan", "--budget-s", "280"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("plan on cuda") and "memory " in out and "of --budget-s 280" in out


@pytest.mark.spawns
def test_a_budget_skips_saying_so_what_would_not_fit_and_records_it(tmp_path, monkeypatch, capsys):
    for name in gpu_check.SECTIONS:
        monkeypatch.setitem(gpu_check.SECTIONS, name, lambda device, preset, scratch, context: {"verdicts": {}})
    monkeypatch.setattr(gpu_plan, "estimate", lambda name, preset, device: {"memory": 5, "oom": 50}.get(name, 1))
    out, work = tmp_path / "gpu_check.json", tmp_path / "work"
    assert gpu_check.main(["--device", "cpu", "--out", str(out), "--work-dir", str(work), "--budget-s", "20"]) == 0
    result = json.loads(out.read_text())
    assert list(result["sections"]) == ["memory", "memory_imagenet", "steptime", "dag"]
    assert set(result["run"]["skipped"]) == {"oom"} and "does not fit" in result["run"]["skipped"]["oom"]
    assert "== oom: skipped" in capsys.readouterr().out
    assert not result["complete"] and set(result["seconds"]) == {*result["sections"], "run"}


@pytest.mark.spawns
def test_the_calls_setup_counts_in_the_slot(tmp_path, monkeypatch):
    """Installing the wheels before the check starts (scripts/gpu-python.sh's TULA_GPU_CALL_STARTED) takes from the
    budget and is recorded, so that the slot's verdict is the device call's whole time."""
    for name in gpu_check.SECTIONS:
        monkeypatch.setitem(gpu_check.SECTIONS, name, lambda device, preset, scratch, context: {"verdicts": {}})
    monkeypatch.setattr(gpu_plan, "estimate", lambda name, preset, device: 5 if name == "memory" else 10)
    monkeypatch.setenv(gpu_check.CALL_STARTED_ENV, str(time.time() - 12))
    out, work = tmp_path / "gpu_check.json", tmp_path / "work"
    assert gpu_check.main(["--device", "cpu", "--out", str(out), "--work-dir", str(work), "--budget-s", "20"]) == 0
    run = json.loads(out.read_text())["run"]
    assert 12 <= run["setup_s"] < 60 and run["seconds"] >= run["setup_s"]
    assert list(run["skipped"]) == ["oom", "memory_imagenet", "steptime", "dag"]  # 12 s + 10 s > 20 s; 12 + 5 fit


# --- the sections' pieces ---------------------------------------------------------------------------------------


SNAKEMAKE_LOG = """Building DAG of jobs...
[Thu Nov 26 04:20:17 2026]
localrule probe_memory:
    output: results/digits-cnn/memory.json
    jobid: 2
[Thu Nov 26 04:20:46 2026]
Finished jobid: 2 (Rule: probe_memory)
[Thu Nov 26 04:20:46 2026]
localcheckpoint plan:
    jobid: 3
[Thu Nov 26 04:20:47 2026]
Finished jobid: 3 (Rule: plan)
[Thu Nov 26 04:20:47 2026]
localrule profile:
    jobid: 11
[Thu Nov 26 04:20:47 2026]
rule profile:
    jobid: 10
[Thu Nov 26 04:20:58 2026]
Finished jobid: 11 (Rule: profile)
[Thu Nov 26 04:21:08 2026]
Finished jobid: 10 (Rule: profile)
"""


def test_each_stages_wall_time_is_read_from_snakemakes_log():
    assert gpu_steps.stage_seconds(SNAKEMAKE_LOG) == {"probe_memory": 29.0, "plan": 1.0, "profile": 11.0 + 21.0}


def test_each_stages_imports_are_added_up_from_its_logs_top_level_lines(tmp_path):
    (tmp_path / "profile").mkdir()
    (tmp_path / "plan.log").write_text(
        "import time: self [us] | cumulative | imported package\n"
        "import time:       120 |        500 |   json.decoder\n"  # inside json: counted in json's 2000
        "import time:       300 |       2000 | json\n"
        "import time:      1000 |    2000000 | tula_hpc.stages.plan\n"
        "[tula-hpc] planned 2 profiles\n"
    )
    (tmp_path / "profile" / "N1_B32.log").write_text("import time:        10 |     250000 | numpy\n")
    assert gpu_steps.import_seconds(tmp_path) == {"plan": 2.002, "profile/N1_B32": 0.25}


@pytest.mark.spawns
def test_the_dags_timeout_stops_only_work_still_running(tmp_path):
    log = tmp_path / "log"
    assert gpu_steps.run_dag([sys.executable, "-c", "print('done')"], log, 30) == (0, False)
    assert "done" in log.read_text() and "import time:" in log.read_text()  # every process logs its imports
    returncode, stopped = gpu_steps.run_dag([sys.executable, "-c", "import time; time.sleep(30)"], log, 0.5)
    assert returncode is None and stopped and "still running" in log.read_text()


@pytest.mark.parametrize(
    "error, real",
    [
        ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB", True),
        ("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8388608 bytes beyond the budget", True),
        ("CUDNN_STATUS_ALLOC_FAILED", True),
        ("NCCL error: unhandled system error", False),
    ],
)
def test_only_the_allocators_own_error_is_a_real_out_of_memory(error, real):
    assert gpu_memory.real_out_of_memory({"outcome": "out_of_memory", "error": error}) is real
    assert not gpu_memory.real_out_of_memory({"outcome": "completed"})


def test_the_stage_is_judged_against_the_truths_bracket():
    truth = {"largest_fits": 1000, "smallest_fails": 1010}
    assert gpu_memory.stage_vs_truth({"answer": 990}, truth) == pytest.approx(0.01)
    assert gpu_memory.stage_vs_truth({"answer": 1010}, truth) is None  # at or above a failing batch: wrong
    assert gpu_memory.stage_vs_truth({"answer": 5000}, {"largest_fits": 1000, "smallest_fails": None}) == 4.0


def test_a_synthetic_data_set_gives_the_steps_asked_for():
    job = gpu_memory.workload_job("cpu", gpu_plan.CIFAR, "x", 128)
    from tula_hpc.training.datasets import load_splits

    assert len(load_splits(job.data, job.train.seed).train) // 128 >= gpu_plan.STEPS_PER_EPOCH
    assert job.data.kwargs == {"channels": 3, "classes": 10, "size": gpu_memory.synthetic_size(128)}


def _case(answer: int, seconds: float, lightning: dict | None) -> dict:
    errors = {"per_trial": {"b=1000": 0.01}}
    case = {
        "case": "c",
        "model_errors": {"allocated": errors, "reserved": {"per_trial": {"b=1000": -0.05}}},
        "truth": {"largest_fits": 1000, "smallest_fails": 1008, "bracketed_within": 0.008},
        "stage": {"one_process": {"answer": answer, "seconds": seconds}, "fresh_processes": {"answer": answer}},
    }
    return {**case, "lightning": lightning} if lightning else case


def test_the_memory_verdicts_judge_the_truth_the_stage_and_its_time_against_lightnings():
    verdicts = gpu_memory.memory_verdicts([_case(995, 20.0, {"answer": 8192, "seconds": 61.0})], [])
    assert verdicts["max"]["figure"] == pytest.approx(0.01) and verdicts["max_reserved"]["figure"] == 0.05
    assert verdicts["truth_bracketed"]["met"] and verdicts["stage_vs_truth"]["figure"] == pytest.approx(0.005)
    assert verdicts["stage_time_over_lightning"] == {"met": True, "figure": 20 / 61, "target": 0.5}
    assert verdicts["both_ways_agree"]["figure"] == 0.0
    # Lightning absent: its comparison is left out, not failed; a stage answer at a failing batch is wrong.
    absent = gpu_memory.memory_verdicts([_case(1008, 20.0, {"skipped": "not importable"})], [])
    assert "stage_time_over_lightning" not in absent and not absent["stage_vs_truth"]["met"]
    crashed = gpu_memory.memory_verdicts([_case(995, 20.0, None)], [{"case": "other", "error": "x"}])
    assert not crashed["max"]["met"] and not crashed["truth_bracketed"]["met"] and not crashed["stage_vs_truth"]["met"]


def test_the_cases_a_gpu_run_writes_leave_the_code_digest_as_it_was(tmp_path, monkeypatch):
    """A split run's second call carries the first call's cases in bench/data/gpu: its sections stay current."""
    for name in ("tula_hpc/a.py", "bench/gpu_check.py", "workflow/r.smk", "config/j.yaml", "profiles/p", "Snakefile"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(name)
    monkeypatch.setattr(gpu_device, "REPO", tmp_path)
    monkeypatch.setattr(common, "REPO", tmp_path)
    before = gpu_device.source_digest()
    (tmp_path / "bench/data/gpu").mkdir(parents=True)
    (tmp_path / "bench/data/gpu/h100-case.json").write_text("{}")
    assert gpu_device.source_digest() == before
    (tmp_path / "bench/gpu_check.py").write_text("changed")
    assert gpu_device.source_digest() != before


def test_a_step_costs_the_small_batches_time_until_the_recorded_full_step_scaled_by_the_batch_is_longer():
    figures = {"step_s": {"m": 0.01}, "full_step": {"m": [512, 0.04]}}
    assert gpu_plan.step_estimate(figures, "m", 64) == 0.01  # launch-bound: 0.005 scaled is less
    assert gpu_plan.step_estimate(figures, "m", 1024) == 0.08
    assert gpu_plan.step_estimate(figures, "other", 1024) == 0.01  # nothing recorded at full: the largest small step
    oom = {"model": "m", "batch": 1024, "epochs": 1, "steps_per_epoch": 10}
    assert gpu_plan.oom_estimate(oom, {**figures, "launch_s": 5}) == 2 * 5 + 10 * 2 * 0.04 + 10 * 0.08


def test_the_result_and_the_cases_this_run_added_are_copied_back_each_in_its_folder(tmp_path):
    cases, back = tmp_path / "cases", tmp_path / "out"
    (cases / "whole_run").mkdir(parents=True)
    (cases / "earlier.json").write_text("{}")
    before = set(cases.rglob("*.json"))
    result = tmp_path / "gpu_check.json"
    result.write_text('{"sections": 1}')
    (cases / "h100-memory.json").write_text("{}")
    assert gpu_check.copy_back(result, cases, before, back) == ["gpu_check.json", "h100-memory.json"]
    (cases / "whole_run" / "h100-run.json").write_text("{}")
    result.write_text('{"sections": 2}')  # the next section: the result again, with what came since
    assert gpu_check.copy_back(result, cases, before, back)[-1] == "whole_run/h100-run.json"
    assert (back / "gpu_check.json").read_text() == '{"sections": 2}'
    assert sorted(p.relative_to(back).as_posix() for p in back.rglob("*") if p.is_file()) == [
        "gpu_check.json",
        "h100-memory.json",
        "whole_run/h100-run.json",
    ]  # no earlier case, no partial copy left behind

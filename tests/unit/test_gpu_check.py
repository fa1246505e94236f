"""bench/gpu_check.py: says so without a GPU and writes nothing; its verdicts, summaries and result file on known
numbers. The whole check on the CPU: tests/integration/test_gpu_check.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
import gpu_check  # noqa: E402  (bench scripts import their siblings as top-level modules)

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
    assert gpu_check.verdict(figure, target) == {"met": met, "figure": figure, "target": target}


def test_a_verdict_on_numpy_figures_is_plain_json():
    found = gpu_check.verdict(np.float64(0.01), 0.02)
    assert type(found["met"]) is bool and type(found["figure"]) is float
    json.dumps(found)


def test_error_summary_takes_magnitudes_and_names_the_worst():
    summary = gpu_check.error_summary({"b=512": 0.01, "b=1024": -0.05, "b=2048": 0.02})
    assert summary == {"count": 3, "median_rel_error": 0.02, "max_rel_error": 0.05, "worst": "b=1024"}
    assert gpu_check.error_summary({}) == {"count": 0, "median_rel_error": None, "max_rel_error": None, "worst": None}


def test_spread_runs_on_a_log_scale_to_the_top():
    assert gpu_check.spread(512, 8192, 5) == [512, 1024, 2048, 4096, 8192]
    assert gpu_check.spread(257, 260, 5) == [257, 258, 259, 260]  # fewer where the range holds fewer
    assert gpu_check.spread(512, 300, 5) == [300] and gpu_check.spread(5, 0, 5) == []


def test_all_verdicts_name_their_section():
    sections = {"memory": {"verdicts": {"median": {"met": True}}}, "dag": {"error": "x"}}
    assert gpu_check.all_verdicts(sections) == {"memory.median": {"met": True}}


def test_the_index_cap_keeps_every_activation_below_2_to_the_31_elements():
    job = {"model": {"name": "tiny_cnn"}, "data": {"image_size": 32}}
    # tiny_cnn's largest output is its second convolution's, 64 x 32 x 32 per image.
    assert gpu_check.index_cap(job, SimpleNamespace(num_classes=10, in_channels=1)) == (2**31 - 1) // (64 * 32 * 32)


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
    figures = gpu_check.step_time_figures(records, SETTINGS)
    assert figures["noise_floor"] == 0.0 and figures["rounds"] == 3
    assert figures["loo"]["count"] == 3 * len(BATCHES) and figures["loo"]["max_rel_error"] < 1e-3
    assert set(figures["per_batch"]) == {str(b) for b in BATCHES}


def test_noise_and_leave_one_out_error_are_judged_against_the_other_rounds():
    """As bench/perf_accuracy.py: truth is the median of the other rounds, of their quiet ones when there are any."""
    records = [_profile(0, b) for b in BATCHES] + [_profile(1, b, scale=1.1) for b in BATCHES]
    records += [_profile(2, b, scale=5.0, interference=0.5) for b in BATCHES]  # disturbed: never the truth
    figures = gpu_check.step_time_figures(records, SETTINGS)
    # Round 0 against round 1 (1.1x): 1/1.1 - 1; round 1 against round 0: +10 %; round 2 against both: 5/1.05 - 1.
    assert figures["noise_floor"] == pytest.approx(0.1)
    assert figures["noise_max"] == pytest.approx(5 / 1.05 - 1)
    assert figures["per_batch"]["16"]["loo_rel_error"] == pytest.approx(0.1, abs=1e-3)


def test_sections_of_an_earlier_run_are_kept_only_for_the_same_code_device_and_scale(tmp_path):
    path = tmp_path / "gpu_check.json"
    device = {"name": "NVIDIA H100 80GB HBM3"}
    earlier = {
        "provenance": {"source_digest": "abc"},
        "device": device,
        "settings": {"scale": "gpu"},
        "sections": {"memory": {"m": 1}, "dag": {"d": 1}},
    }
    path.write_text(json.dumps(earlier))
    assert gpu_check.kept_sections(path, device, "gpu", "abc", ["dag"]) == {"memory": {"m": 1}}
    assert gpu_check.kept_sections(path, device, "gpu", "other code", ["dag"]) == {}
    assert gpu_check.kept_sections(path, device, "quick", "abc", ["dag"]) == {}
    assert gpu_check.kept_sections(tmp_path / "none.json", device, "gpu", "abc", ["dag"]) == {}


def test_without_git_the_commit_comes_from_the_caller_and_the_digest_names_the_code(monkeypatch):
    def no_git():
        raise subprocess.CalledProcessError(128, ["git", "rev-parse", "HEAD"])

    monkeypatch.setattr(gpu_check, "provenance", no_git)
    monkeypatch.setenv("TULA_GIT_COMMIT", "f00d")
    found = gpu_check.provenance_here()
    assert found["git_commit"] == "f00d" and found["git_dirty"] is None
    assert (
        found["source_digest"] == gpu_check.files_digest(list(gpu_check.SOURCES)) and len(found["source_digest"]) == 16
    )
    assert {"processor", "python", "torch", "written_at"} <= set(found)

"""bench/trace_accuracy.py: a synthetic trace generated exactly by a model the fit can represent replays with no
error, no regret and the true knee, and its result file opens with the summary; no measurement."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
bench = importlib.import_module("trace_accuracy")
sys.path.remove(str(BENCH))

PARAMETERS, BYTES = 1_000_000, 4
LATENCY_S, SECONDS_PER_BYTE = 2e-4, 1e-9  # inter-node ring
NODES, BATCHES = (1, 2, 4, 8), (16, 32, 64, 128)


def compute_s(b: int) -> float:
    return 0.01 + 2e-4 * (b - BATCHES[0])


def sync_s(nodes: int) -> float:
    """A ring all-reduce among `nodes` hosts of one GPU each (0 on one)."""
    hops, moved = 2 * (nodes - 1), 2 * (nodes - 1) / nodes * PARAMETERS * BYTES
    return LATENCY_S * hops + SECONDS_PER_BYTE * moved


def write_trace(root: Path) -> Path:
    """One model, one GPU per node: placements.csv for 1-4 nodes (and rows the replay must skip), scalability.csv
    for 8; step = compute + sync with all of sync exposed."""
    folder = root / "synthetic"
    folder.mkdir(parents=True)
    (folder / "trace.yaml").write_text(
        f"parameters: {PARAMETERS}\nbytes_per_parameter: {BYTES}\ntrain_samples: 8192\nepochs: 2\n"
    )
    rows = ["placement,local_bsz,step_time,sync_time"]
    for nodes in NODES[:3]:
        rows += [f"{'1' * nodes},{b},{compute_s(b) + sync_s(nodes)},{sync_s(nodes)}" for b in BATCHES]
    rows.append("21,16,9.0,9.0")  # heterogeneous: not replayed
    (folder / "placements.csv").write_text("\n".join(rows) + "\n")
    rows = ["num_nodes,num_replicas,local_bsz,step_time,sync_time"]
    rows += [f"8,8,{b},{compute_s(b) + sync_s(8)},{sync_s(8)}" for b in BATCHES]
    rows.append("8,12,16,9.0,9.0")  # not a whole number of GPUs per node: not replayed
    (folder / "scalability.csv").write_text("\n".join(rows) + "\n")
    return root


def test_read_trace_keeps_homogeneous_points(tmp_path):
    trace = bench.read_trace(write_trace(tmp_path) / "synthetic")
    assert list(trace["points"]) == [1]
    assert sorted(trace["points"][1]) == [(n, b) for n in NODES for b in BATCHES]


def test_sync_mappings_split_the_step(tmp_path):
    points = bench.read_trace(write_trace(tmp_path) / "synthetic")["points"][1]
    exposed = bench.sync_split(points, "exposed")[(2, 32)]
    assert exposed == pytest.approx((compute_s(32) + sync_s(2), compute_s(32), sync_s(2)))
    assert bench.sync_split(points, "largest")[(2, 32)][2] == pytest.approx(sync_s(2))
    assert bench.sync_split(points, "latent")[(2, 32)] == pytest.approx(exposed[:2] + (None,))  # no sync part
    with pytest.raises(ValueError, match="sync mapping"):
        bench.sync_split(points, "whole")


def test_exact_trace_replays_without_error(tmp_path):
    out = tmp_path / "result.json"
    assert bench.main(["--traces", str(write_trace(tmp_path / "traces")), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert next(iter(result)) == "summary"
    summary = result["summary"]
    assert list(summary) == [
        "partial_median_error",
        "partial_max_error",
        "full_loo_median_error",
        "time_regret_mean",
        "time_regret_max",
        "cost_regret_mean",
        "cost_regret_max",
        "knee_same_share",
        "sigma1_coverage",
    ]
    assert summary["partial_max_error"] < 1e-3
    assert summary["full_loo_median_error"] < 1e-3
    for key in ("time_regret_max", "cost_regret_max"):
        assert summary[key] == pytest.approx(0.0, abs=1e-9)
    assert summary["knee_same_share"] == 1.0
    assert summary["sigma1_coverage"] == 1.0  # errors of ~0 lie inside any band
    assert result["verdicts"]["partial_max_error"]["met"] and result["verdicts"]["time_regret_mean"]["met"]
    assert not result["verdicts"]["sigma1_coverage"]["met"]  # a band too wide is not calibrated either
    (case,) = result["details"]
    assert case["candidates"] == len(NODES) * len(BATCHES)
    assert case["modes"]["partial"]["params"]["overlap_gamma"] == pytest.approx(1.0, rel=1e-2)
    assert result["roughness"]["count"] == len(NODES) * (len(BATCHES) - 2)


def test_an_epochs_last_smaller_step_is_timed_by_the_trace_between_its_batches():
    steps = {(2, 16): 1.0, (2, 32): 2.0, (2, 64): 3.0}
    assert bench.traced_step(steps, 2, 32) == 2.0
    assert bench.traced_step(steps, 2, 48) == pytest.approx(2.5)
    assert bench.traced_step(steps, 2, 8) == pytest.approx(0.5)  # below the traced batches: along the first two
    assert bench.traced_step(steps, 2, 96) == pytest.approx(4.0)

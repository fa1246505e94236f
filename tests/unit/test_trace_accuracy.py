"""bench/trace_accuracy.py: a synthetic trace generated exactly by a model the fit can represent replays with no
error, no regret and the true knee, and its result file opens with the summary; no measurement."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest
from tula_bench import trace_accuracy as bench

PARAMETERS, BYTES = 1_000_000, 4
LATENCY_S, SECONDS_PER_BYTE = 2e-4, 1e-9  # inter-node ring
NODES, BATCHES = (1, 2, 4, 8), (16, 32, 64, 128)


def compute_s(b: int) -> float:
    return 0.01 + 2e-4 * (b - BATCHES[0])


def ring(peers: int, latency_s: float, seconds_per_byte: float) -> float:
    hops, moved = 2 * (peers - 1), 2 * (peers - 1) / peers * PARAMETERS * BYTES
    return latency_s * hops + seconds_per_byte * moved


def sync_s(nodes: int, gpus: int = 1) -> float:
    """A ring all-reduce among each node's `gpus` GPUs (at the GPU prior's latency, which the fit holds when one
    size of it is profiled), then among `nodes` hosts (0 on one rank)."""
    return ring(gpus, 5e-6, 1 / 40e9) + ring(nodes, LATENCY_S, SECONDS_PER_BYTE)


def write_trace(root: Path, gpus: tuple[int, ...] = (1,)) -> Path:
    """One model at each of `gpus` GPUs per node: placements.csv for 1-4 nodes (and rows the replay must skip),
    scalability.csv for 8; step = compute + sync with all of sync exposed."""
    folder = root / "synthetic"
    folder.mkdir(parents=True)
    (folder / "trace.yaml").write_text(
        f"parameters: {PARAMETERS}\nbytes_per_parameter: {BYTES}\ntrain_samples: 8192\nepochs: 2\nrecipe_batch: 64\n"
    )
    rows = ["placement,local_bsz,step_time,sync_time"]
    for g in gpus:
        for nodes in NODES[:3]:
            sync = sync_s(nodes, g)
            rows += [f"{str(g) * nodes},{b},{compute_s(b) + sync},{sync}" for b in BATCHES]
    rows.append("21,16,9.0,9.0")  # heterogeneous: not replayed
    (folder / "placements.csv").write_text("\n".join(rows) + "\n")
    rows = ["num_nodes,num_replicas,local_bsz,step_time,sync_time"]
    rows += [f"8,{8 * g},{b},{compute_s(b) + sync_s(8, g)},{sync_s(8, g)}" for g in gpus for b in BATCHES]
    rows.append("8,12,16,9.0,9.0")  # not a whole number of GPUs per node: not replayed
    (folder / "scalability.csv").write_text("\n".join(rows) + "\n")
    return root


def test_read_trace_keeps_homogeneous_points(tmp_path):
    trace = bench.read_trace(write_trace(tmp_path) / "synthetic")
    assert trace["gpus"] == [1]
    assert sorted(trace["points"]) == [(n, 1, b) for n in NODES for b in BATCHES]


def test_sync_mappings_split_the_step(tmp_path):
    points = bench.read_trace(write_trace(tmp_path) / "synthetic")["points"]
    exposed = bench.sync_split(points, "exposed")[(2, 1, 32)]
    assert exposed == pytest.approx((compute_s(32) + sync_s(2), compute_s(32), sync_s(2)))
    assert bench.sync_split(points, "largest")[(2, 1, 32)][2] == pytest.approx(sync_s(2))
    latent = bench.sync_split(points, "latent")[(2, 1, 32)]
    assert latent[:2] == pytest.approx(exposed[:2]) and latent[2] is None  # no sync part
    with pytest.raises(ValueError, match="sync mapping"):
        bench.sync_split(points, "whole")


@pytest.mark.spawns
def test_exact_trace_replays_without_error(tmp_path):
    """No noise: partial search predicts the exact trace, confirms its choices at a share of the grid's cost and
    chooses the true best."""
    out = tmp_path / "result.json"
    traces = write_trace(tmp_path / "traces")
    assert bench.main(["--traces", str(traces), "--out", str(out), "--noise", "0", "--seeds", "1"]) == 0
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
        "profile_cost_share",
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
    steps = {(2, 4, 16): 1.0, (2, 4, 32): 2.0, (2, 4, 64): 3.0, (2, 1, 16): 9.0}
    assert bench.traced_step(steps, 2, 4, 32) == 2.0
    assert bench.traced_step(steps, 2, 4, 48) == pytest.approx(2.5)
    assert bench.traced_step(steps, 2, 4, 8) == pytest.approx(0.5)  # below the traced batches: along the first two
    assert bench.traced_step(steps, 2, 4, 96) == pytest.approx(4.0)


@pytest.mark.spawns
def test_gpus_per_node_as_a_choice_replays_without_error_and_chooses_the_best_shape(tmp_path):
    """1 or 2 GPUs per node in one grid: partial search over node shapes predicts every unprofiled shape exactly
    and the time and cost objectives choose the true best shape."""
    result = bench.run(write_trace(tmp_path, gpus=(1, 2)), seeds=1, noise=0.0)
    assert [case["gpus_per_node"] for case in result["details"]] == [[1], [2]]
    (case,) = result["node_shape_details"]
    assert case["gpus_per_node"] == [1, 2]
    assert {p["gpus_per_node"] for p in case["modes"]["partial"]["profiled"]} == {1, 2}
    partial = result["node_shapes"]["partial"]
    assert partial["max_error"]["error"] < 1e-3
    assert partial["time_regret_max"] == pytest.approx(0.0, abs=1e-9)
    assert partial["time_same_gpus_per_node_share"] == partial["cost_same_gpus_per_node_share"] == 1.0


def test_each_profile_read_has_its_seeds_noise_at_the_given_level():
    """The same configuration reads the same within a seed, another seed reads otherwise; over many reads the log
    of the factor has the given standard deviation; no noise reads the trace as it is."""
    point = (2, 4, 64)
    assert bench.noise_factor(3, "cifar10", point, 0.05) == bench.noise_factor(3, "cifar10", point, 0.05)
    assert bench.noise_factor(3, "cifar10", point, 0.05) != bench.noise_factor(4, "cifar10", point, 0.05)
    assert bench.noise_factor(3, "cifar10", point, 0.0) == 1.0
    logs = [math.log(bench.noise_factor(seed, "m", (n, 1, 32), 0.05)) for seed in range(20) for n in range(1, 51)]
    assert statistics.pstdev(logs) == pytest.approx(0.05, rel=0.1) and abs(statistics.fmean(logs)) < 0.005


@pytest.mark.spawns
def test_noisy_reads_are_averaged_over_seeds_and_the_search_confirms_within_its_limit(tmp_path):
    """With noise the unprofiled candidates are off by about the noise, the summary is the seeds' mean, and each
    job's confirming profiles stay within search.confirm and cost less than the whole grid."""
    result = bench.run(write_trace(tmp_path), seeds=2, noise=0.05)
    assert result["noise"] == {"seeds": 2, "sigma": 0.05, "of": "given"}
    by_seed = result["summary_by_seed"]
    assert result["summary"]["time_regret_mean"] == pytest.approx(
        statistics.fmean(s["time_regret_mean"] for s in by_seed)
    )
    assert by_seed[0] != by_seed[1]
    assert 0.005 < result["summary"]["partial_median_error"] < 0.2
    limit = bench.default_constants(bench.bench_job()).get("confirm")
    for choice in result["details"][0]["modes"]["partial"]["choices"]:
        for goal in bench.GOALS:
            assert len(choice[f"{goal}_confirmed"]) <= limit
            assert 0 < choice[f"{goal}_profile_cost_share"] < 1


def test_a_smoke_run_loads_each_models_points_on_one_node_at_its_smallest_g(tmp_path):
    """--smoke replays in seconds: one node, the smallest GPUs per node, every traced batch there."""
    (trace,) = bench.load_traces(write_trace(tmp_path, gpus=(2, 4)), smoke=True)
    assert trace["gpus"] == [2]
    assert sorted(trace["points"]) == [(1, 2, b) for b in BATCHES]


def test_a_smoke_run_needs_its_own_result_file(capsys):
    """A smoke result never replaces bench/results/trace_accuracy.json."""
    with pytest.raises(SystemExit):
        bench.main(["--smoke"])
    assert "--out" in capsys.readouterr().err

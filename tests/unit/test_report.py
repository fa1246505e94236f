"""The report stage reads the files it is given and writes exactly the files it is told to (the rule declares them)."""

import json
from dataclasses import replace

from tests.conftest import REPO
from tula_hpc.core.records import FitResult, Selection, TrainSummary
from tula_hpc.stages.report import main

GRID = [(nodes, batch) for nodes in (1, 2) for batch in (64, 128, 256)]


def _candidate(nodes: int, batch: int) -> dict:
    step = 0.01 + 0.0001 * batch / nodes
    time = step * 1000 / batch
    return {
        "nodes": nodes,
        "batch": batch,
        "per_device_batch": batch // nodes,
        "data_s": 0.2 * step,
        "step_s": step,
        "rel_uncertainty": 0.05,
        "time_s": time,
        "time_s_range": [0.95 * time, 1.05 * time],
        "cost": time * nodes,
    }


CANDIDATES = [_candidate(n, b) for n, b in GRID]
CHOSEN = CANDIDATES[4]  # 2 nodes, batch 128

INPUTS = {
    "memory": {
        "fit": {"intercept_bytes": 2e7, "slope_bytes_per_sample": 3e4},
        "fit_reserved": {"intercept_bytes": 2.1e7, "slope_bytes_per_sample": 3.1e4},
        "composition": {
            "fixed_bytes": {
                "parameters_and_buffers": 1e6,
                "optimizer_state": 1e6,
                "workspace": 4e6,
                "autocast_weight_copies": 5e5,
                "ddp_buckets": 1e6,
                "nccl_ring_buffers": 0,
                "gradients_and_temporaries": 1.35e7,
            },
            "per_sample_bytes": {"batch": 300.0, "saved_activations": 2e4, "temporaries": 9.7e3},
        },
        "verified": True,
        "limit": {
            "limit": 530,
            "smallest_failed": 535,
            "without_retry": 512,
            "allowance_bytes": 3.2e8,
            "chosen": 512,
            "limited_by_memory": True,
            "cuda_alloc_conf": "expandable_segments:True",
        },
        "device_memory_bytes": 8e9,
        "device_memory_source": "resources.device_memory_gb: 8",
        "headroom": 0.1,
        "outside_allocator_bytes": 5e8,
        "collective_buffer_bytes": 6e8,
        "max_batch_per_device": 512,
        "probes": [
            {
                "batch": b,
                "outcome": "measured",
                "peak_bytes": 20_000_000 + 30_000 * b,
                "reserved_peak_bytes": 21_000_000 + 31_000 * b,
                "activation_bytes": 30_000 * b,
                "grad_bytes": 1_000_000,
                "optimizer_bytes": 1_000_000,
                "workspace_bytes": 4_000_000,
                "autocast_weight_bytes": 500_000,
            }
            for b in (32, 64)
        ],
    },
    "plan": {"mode": "full", "candidates": [{"nodes": n, "batch": b} for n, b in GRID]},
    "perfmodel": {
        "job": "toy",
        "pricing": "node_hours",
        "collective": "ring",
        "candidates": CANDIDATES,
        "profiled": [
            {
                "nodes": c["nodes"],
                "batch": c["batch"],
                "per_device_batch": c["per_device_batch"],  # as fit_model writes it
                "measured_step_s": c["step_s"] * 1.02,
                "predicted_step_s": c["step_s"],
                "step_iqr_over_median": 0.03,
                "interference": 0.0,
            }
            for c in CANDIDATES
        ],
        "params": {
            "data_intercept_s": 1e-4,
            "data_per_sample_s": 1e-6,
            "intercept_s": 0.01,
            "per_sample_s": 1e-4,
            "batch_ref": 64,
            "contention_s": 0.0,
            "contention_per_sample_s": 0.0,
            "intra_node_latency_s": 1e-5,
            "intra_node_seconds_per_byte": 1e-10,
            "inter_node_latency_s": 1.4e-5,
            "inter_node_seconds_per_byte": 8e-11,
            "overlap_gamma": 2.0,
            "exposed_sync_share": [
                {"ranks": 2, "per_device_batch": 32, "share": 0.8},
                {"ranks": 2, "per_device_batch": 256, "share": 0.25},
            ],
            "rms_rel_error": 0.02,
            "sync_fit": "split",
            "inter_sync_levels": [],
            "compute_kinks": [],
        },
        "identified": {
            "intra_node_latency_s": True,
            "intra_node_seconds_per_byte": True,
            "inter_node_latency_s": False,
            "inter_node_seconds_per_byte": False,
            "contention_s": False,
        },
        "leave_one_out": {"count": 6, "median_rel_error": 0.03, "max_rel_error": 0.08},
        "search": {"history": [], "stopped": "full grid"},
        "noise_scale": None,
        "notes": [],
        "grad_bytes": 4.0e5,
        "train_samples": 1280,
        "epochs": 2,
        "measurement_weight": 0.0,
    },
    "selection": {
        "job": "toy",
        "chosen": CHOSEN,
        "objective": "time",
        "pricing": "node_hours",
        "constraints": {"max_cost": None},
        "feasible": 6,
        "candidates": 6,
        "knees": {"kneedle": 128, "model": 128},
        "knee_min_saving": 0.1,
        "knee_method": "model",
        "runners_up": CANDIDATES[:2],
        "best_time_curve": [{k: c[k] for k in ("batch", "nodes", "time_s")} for c in CANDIDATES[3:]],
        "predicted": {"time_s": CHOSEN["time_s"], "cost": CHOSEN["cost"], "to": "epochs"},
    },
    "summary": {
        "strategy": "ags",
        "nodes": 2,
        "world_size": 2,
        "global_batch": 128,
        "per_device_batch": 64,
        "accumulation": 2,
        "train_samples": 1280,
        "resumed_from_epoch": 1,
        "resumed_from_step": 13,
        "restarts_at_steps": [13],
        "train_time_s": 9.0,
        "train_time_with_lost_work_s": 12.5,
        "wall_time_s": 12.0,
        "steps": 20,
        "steps_per_epoch": 10,
        "micro_batch": 32,
        "peak_reserved_bytes": 22_500_000,
        "peak_allocated_bytes": 21_200_000,
        "outside_allocator_bytes": 1_234_000_000,
        "attempts": [
            {
                "global_batch": 128,
                "per_device_batch": 64,
                "accumulation": 1,
                "micro_batch": 64,
                "outcome": "out_of_memory",
                "rank": 1,
                "error": "can't allocate memory",
                "noticed_after_s": 0.4,
            },
            {"global_batch": 128, "per_device_batch": 64, "accumulation": 2, "micro_batch": 32, "outcome": "completed"},
        ],
        "epochs": 2,
        "history": [
            {
                "epoch": e,
                "loss": 1.0 / e,
                "val_accuracy": 0.4 * e,
                "data_wait_s": 0.45,
                "noise_scale": {"b_noise": 300.0 * e, "gradient_sq": 0.5, "trace_sigma": 150.0 * e, "steps": 10 * e},
                "ags": {
                    "steps": 10,
                    "scaled_steps": 5,
                    "scaled_fraction": 0.5,
                    "gradscale_updates": e - 1,
                    "delta": {"min": 0.1, "median": 0.2, "max": 0.4, "mean": 0.2},
                    "scale_hist": {"edges": [0.25, 0.5, 1.0, 2.0, 4.0], "counts": [1, 2, 3, 4]},
                },
            }
            for e in (1, 2)
        ],
    },
    "eval": {
        "predicted_train_time_s": 8.5,
        "measured_train_time_s": 9.0,
        "measured_train_time_with_lost_work_s": 12.5,
        "pricing": "node_hour",
        "predicted_cost": 0.005,
        "measured_cost": 0.0052,
        "measured_cost_with_lost_work": 0.0071,
        "time_rel_error": 0.06,
        "test_accuracy": 0.9,
        "test_samples": 360,
    },
}

PLOTS = {
    "--time-plot": "time_vs_batch.png",
    "--cost-plot": "cost_surface.png",
    "--accuracy-plot": "predicted_vs_measured.png",
    "--training-plot": "plots/training.png",  # a plot in a sub-folder: the link must follow it
}


def test_report_writes_exactly_its_declared_outputs_and_links_each_plot(tmp_path):
    given, out_dir = tmp_path / "given", tmp_path / "out"
    given.mkdir()
    args = ["--config", str(REPO / "config" / "jobs.yaml"), "--job", "digits-cnn"]
    for name, content in INPUTS.items():
        (given / f"{name}.json").write_text(json.dumps(content))
        args += [f"--{name}", str(given / f"{name}.json")]
    outputs = {"--out": "report.md", **PLOTS}
    for flag, name in outputs.items():
        args += [flag, str(out_dir / name)]

    assert main(args) == 0

    written = {str(p.relative_to(out_dir)) for p in out_dir.rglob("*") if p.is_file()}
    assert written == set(outputs.values())  # no temporary or undeclared file left behind
    for name in PLOTS.values():
        assert (out_dir / name).read_bytes()[:4] == b"\x89PNG"
    report = (out_dir / "report.md").read_text()
    assert "**2 node(s), global batch 128**" in report
    for name in PLOTS.values():
        assert f"]({name})" in report
    # A preemption saved mid-epoch; running out of memory relaunched at the same global batch.
    assert "resumed from its checkpoint at step 13 (epoch 2, step 3)" in report
    assert "known here at most 0.4 s after the rank recorded it" in report
    assert "64 per device as 2 x 32: completed" in report
    # Which sync terms the profiles fitted and which are the job's priors.
    assert "intra-node 10.0 us per hop (fitted) + 0.100 s/GB moved (fitted)" in report
    assert "inter-node 14.0 us per hop (prior) + 0.080 s/GB moved (prior)" in report
    assert "overlap g = 2.00 (exposed share of sync at N = 2: 80% at b = 32, 25% at b = 256)" in report
    # The allocated bytes size the batch: 20 MB + 30 kB x 512 allocated, 21 MB + 31 kB x 512 reserved in the probes.
    assert "35.4 MB allocated at batch 512, for which the caching allocator reserved 36.9 MB" in report
    # CUDA's trials bracketed the card's limit: both largest batches and the allowance are shown.
    assert "the largest batch that ran is 530, 535 ran out of memory" in report
    assert "needed no allocator retry is 512" in report and "could not give back 320.0 MB" in report
    # The fixed memory by what holds it: cuBLAS's workspace is not optimiser state, autocast's weight copies are
    # not activations.
    assert (
        "of which fixed parameters and buffers 1.00 MB, optimiser state 1.00 MB, workspace kept (cuBLAS, cuDNN) "
        "4.00 MB, autocast's weight copies 0.50 MB, DDP buckets 1.00 MB, NCCL ring buffers (estimated) 0.00 MB, "
        "gradients and temporaries 13.50 MB;\nper sample batch 0.30 kB" in report
    )
    # Training's loading and device memory held against what the profiles and the memory model said.
    assert "training waited 0.90 s for its loader (10.0% of the steps' time)" in report
    assert "load for 20.0% of a step at this configuration" in report
    assert "Training's peak device memory 21.20 MB allocated (22.50 MB reserved) against 20.96 MB" in report
    assert "at 32 samples per device at once" in report
    assert "(CUDA context, NCCL's communicators) 1234.0 MB in training, against 1100.0 MB" in report
    assert "| 32 | measured | 20960000 | 21992000 | 960000 | 500000 | 1000000 | 1000000 | 4000000 |" in report


def test_the_report_shows_the_chosen_node_shape_and_tells_shapes_with_the_same_nodes_apart(tmp_path):
    """Two GPUs per node beside one at the same N: each its own row, curve and cost cell."""
    shaped = [{**c, "gpus_per_node": 1} for c in CANDIDATES]
    shaped += [{**c, "gpus_per_node": 2, "per_device_batch": c["per_device_batch"] // 2} for c in CANDIDATES]
    chosen = shaped[-2]  # 2 nodes x 2 GPUs, batch 128
    inputs = {
        **INPUTS,
        "perfmodel": {**INPUTS["perfmodel"], "candidates": shaped},
        "selection": {**INPUTS["selection"], "chosen": chosen, "runners_up": shaped[:1]},
    }
    args = ["--config", str(REPO / "config" / "jobs.yaml"), "--job", "digits-cnn"]
    for name, content in inputs.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(content))
        args += [f"--{name}", str(tmp_path / f"{name}.json")]
    for flag, name in {"--out": "report.md", **PLOTS}.items():
        args += [flag, str(tmp_path / name)]
    assert main(args) == 0
    report = (tmp_path / "report.md").read_text()
    assert "**2 node(s) x 2 GPU(s), global batch 128** (32 per device)" in report
    assert "| runner-up N | GPUs/node | B |" in report and "| 1 | 1 | 64 |" in report
    assert "| 2 | 2 | 128 | 32 |" in report and "| 2 | 1 | 128 | 64 |" in report  # every candidate, shapes apart


def test_the_report_says_which_sync_fit_ran_where_compute_kinks_and_host_counts_with_their_own_sync(tmp_path):
    from tula_hpc.stages.report import _model_section

    perfmodel = FitResult.from_dict(INPUTS["perfmodel"])
    assert "(split fit)" in _model_section(INPUTS["plan"], perfmodel)
    assert "kinks" not in _model_section(INPUTS["plan"], perfmodel)
    kinks = [{"per_device_batch": 32.0, "over_line": 1.0}, {"per_device_batch": 64.0, "over_line": 0.8}]
    perfmodel = replace(perfmodel, params={**perfmodel.params, "sync_fit": "latent", "compute_kinks": kinks})
    section = _model_section(INPUTS["plan"], perfmodel)
    assert "latent: fitted with g to the overlapped steps alone" in section
    assert "(kinks): 1.00 at b = 32, 0.80 at b = 64" in section
    assert "its own level" not in section
    levels = [{"hosts": 2, "over_line": 1.91}]
    perfmodel = replace(perfmodel, params={**perfmodel.params, "inter_sync_levels": levels})
    assert "times its own level where a host count's profiles agree on one: 1.91 at 2 hosts" in _model_section(
        INPUTS["plan"], perfmodel
    )
    assert "slower beside the all-reduce" not in _model_section(INPUTS["plan"], perfmodel)
    perfmodel = replace(perfmodel, params={**perfmodel.params, "interference": 0.083})
    assert "multi-rank compute 8.3% slower beside the all-reduce (interference)" in _model_section(
        INPUTS["plan"], perfmodel
    )


def test_the_report_sets_time_to_the_recipes_progress_beside_time_per_recipe():
    from tula_hpc.stages.report import _progress

    selection = Selection.from_dict(
        {
            **INPUTS["selection"],
            "chosen": {**CHOSEN, "progress_epochs": 3.5, "progress_time_s": 7.25, "progress_cost": 0.5},
            "predicted": {"time_s": 7.25, "cost": 0.5, "to": "progress"},
        }
    )
    noise_scale = {"b_noise": 96.0, "profiles": 3, "range": [80.0, 120.0]}
    perfmodel = FitResult.from_dict({**INPUTS["perfmodel"], "noise_scale": noise_scale})
    line = _progress(selection, perfmodel)
    assert "B_noise = 96, median of 3" in line and "in 3.5 epochs, 7.25 s, cost 0.5" in line
    assert line.endswith("Training runs to its progress.")
    assert "no multi-rank profile" in _progress(selection, replace(perfmodel, noise_scale=None))


def test_the_report_names_the_partitions_limits_the_queue_wait_and_the_wall_time_asked_for():
    from tula_hpc.stages.report import _cluster

    plan = {
        "partition": {
            "partition": "gpu",
            "excluded": [{"nodes": 8, "breaks": ["8 nodes > partition gpu's MaxNodes=4"]}],
        }
    }
    selection = Selection.from_dict(
        {**INPUTS["selection"], "predicted": {"time_s": 600.0, "wait_s": 300.0, "result_time_s": 900.0}}
    )
    summary = TrainSummary.from_dict({**INPUTS["summary"], "time_limit_min": 27})
    line = _cluster(plan, selection, summary)
    assert "Partition gpu left out 1 candidates: 8 nodes > partition gpu's MaxNodes=4." in line
    assert "a wait of 300 s before the 600.0 s of training, 900.0 s to the result" in line
    assert "Slurm's estimate at selection time" in line and "asked for a wall time of 27 min" in line
    no_wait, no_limit = replace(selection, predicted={"time_s": 1.0}), replace(summary, time_limit_min=None)
    assert _cluster({"partition": None}, no_wait, no_limit) == ""


def test_the_report_says_whether_the_loaders_workers_keep_up_with_the_step():
    from tula_hpc.stages.report import _loading

    summary = TrainSummary.from_dict(INPUTS["summary"])
    chosen = {**CHOSEN, "model_step_s": 0.02, "loader_s": 0.03, "loader_bound": True}
    line = _loading(Selection.from_dict({**INPUTS["selection"], "chosen": chosen}), summary)
    assert line.endswith(
        "Its workers make a batch every 30.0 ms against a predicted 20.0 ms step: the loader sets the pace; more "
        "loader workers (data.num_workers, resources.cpus_per_task) or cheaper loading would save up to 10.0 ms a step."
    )
    chosen = {**chosen, "loader_s": 0.01, "loader_bound": False}
    assert _loading(Selection.from_dict({**INPUTS["selection"], "chosen": chosen}), summary).endswith("keeps up.")
    assert "workers" not in _loading(Selection.from_dict(INPUTS["selection"]), summary)  # no loader timed

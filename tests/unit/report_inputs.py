"""The files a report is made from, as the earlier stages write them: a toy job on a grid of 1-2 nodes and
batches 64-256 (tests of the report stage and of its sections)."""

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

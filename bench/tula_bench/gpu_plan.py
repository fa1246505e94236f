"""The GPU check's presets and its plan: what each section measures at each scale, how long it will take, and which
sections fit a slot (bench/gpu_check.py --budget-s, `make gpu-dry-run`).

A GPU is lent for one short slot; a section cut by the slot's end measured nothing. So the sections run in order of
value (VALUE: the memory truths first, the DAG last) and each is estimated before it starts, from seconds recorded on
a real run (FIGURES, each with where it came from) scaled by the preset's size (how many cases, steps, launches); a
section whose estimate does not fit what is left of the budget is skipped, saying so.
"""

from __future__ import annotations

from tula_hpc.core.run_layout import doublings

# Most valuable first: the largest batch's truth at CIFAR's shape with the stage's time to it and Lightning's,
# the OOM relaunch, the truths at ImageNet's shape, then step times, then the whole DAG (whose stages the other
# sections already measure one by one).
VALUE = ("memory", "oom", "memory_imagenet", "steptime", "dag")
STEPS_PER_EPOCH = 200  # every trained epoch has at least this many steps (steady epochs are judged from the third)
SLOT_S = 9 * 60  # the whole default preset, installing the wheels included, on one H100 or H200

# Workloads: CIFAR-10's shape with resnet18, ImageNet's with resnet50 (bf16, channels_last) and vit_b_16 (bf16).
CIFAR = {"model": "resnet18", "image_size": 32, "precision": "fp32", "classes": 10}
IMAGENET_RESNET = {"model": "resnet50", "image_size": 224, "precision": "bf16", "channels_last": True, "classes": 1000}
IMAGENET_VIT = {"model": "torchvision.models:vit_b_16", "image_size": 224, "precision": "bf16", "classes": 1000}
TINY = {"model": "tiny_cnn", "image_size": 8, "precision": "fp32", "classes": 10}
BOTH_WAYS = ["one_process", "fresh_processes"]  # the probe stage timed both ways (resources.memory_probes_in)
# PyTorch Lightning's BatchSizeFinder as a user runs it: binsearch from 2, no margin, no cap of its own.
LIGHTNING = {"steps_per_trial": 3, "init_val": 2, "max_trials": 25, "max_val": 1 << 20}
PRESETS = {
    "gpu": {
        "memory": {
            # The probe stage in one process only: both ways agreed within 0.64 % on the H200 at 3ca5bc3
            # (bench/results/gpu_check.json before this preset), and the fresh processes' 89 s do not fit the slot.
            "cases": {"resnet18_32_fp32": {**CIFAR, "warmup_batch": 512, "lightning": True, "stage": ["one_process"]}},
            "device_memory_gb": "auto",  # the whole card
            "lightning": LIGHTNING,
        },
        "memory_imagenet": {
            "cases": {
                "resnet50_224_bf16_cl": {**IMAGENET_RESNET, "warmup_batch": 128, "lightning": True, "stage": []},
                "vit_b_16_224_bf16": {**IMAGENET_VIT, "warmup_batch": 128, "lightning": True, "stage": []},
            },
            "device_memory_gb": "auto",
            "lightning": LIGHTNING,
        },
        "oom": {**CIFAR, "batch": 1024, "epochs": 1, "cpus_per_task": 4},
        "steptime": {
            # 4 cores a rank (3 loader workers) as a GPU job gets them; per-device batches where a step is the
            # device's work, as in the jobs users size to the card: below them the H200's steps are the host's
            # launches, flat in the batch and repeating only within 10-50 % (GPU-bound ones within 0.4 %:
            # bench/data/gpu/README.md, 2026-11-27).
            "cases": [
                {**CIFAR, "batch": {"min": 256, "max": 1024}, "cpus_per_task": 4},
                {**IMAGENET_RESNET, "batch": {"min": 64, "max": 256}, "cpus_per_task": 4},
                {**IMAGENET_VIT, "batch": {"min": 64, "max": 256}, "cpus_per_task": 4},
            ],
            "rounds": 2,
            "measurement": {"min_measure_s": 0.25},
            "epochs_trained": 3,
        },
        "dag": {"changes": {}, "timeout_s": 400},
    },
    "quick": {  # every section at tiny sizes on the CPU: a test of the check's own code
        "memory": {
            "cases": {"tiny_cnn_8_fp32": {**TINY, "warmup_batch": 32, "lightning": True, "stage": BOTH_WAYS}},
            "device_memory_gb": 0.1,
            "lightning": {"steps_per_trial": 1, "init_val": 2, "max_trials": 25, "max_val": 4096},
        },
        "memory_imagenet": {
            "cases": {"tiny_cnn_16_bf16": {**TINY, "image_size": 16, "precision": "bf16", "warmup_batch": 32}},
            "device_memory_gb": 0.1,
            "lightning": {},
        },
        "oom": {**TINY, "batch": 512, "epochs": 1, "steps_per_epoch": 20},
        "steptime": {
            "cases": [{**TINY, "batch": {"min": 16, "max": 64}}],
            "rounds": 2,
            "measurement": {"warmup_steps": 1, "steps": 2, "min_measure_s": 0.05, "max_attempts": 1},
            "epochs_trained": 3,
        },
        "dag": {
            "changes": {
                "train": {"epochs": 2, "lr_milestones": []},
                "search": {
                    "batch": {"min": 64, "max": 128},
                    "warmup_steps": 1,
                    "steps": 2,
                    "min_measure_s": 0.05,
                    "max_attempts": 1,
                },
            },
            "timeout_s": 900,
        },
    },
}

# Seconds recorded on real runs, each with its source, that the estimates scale.
H200_RUN = (
    "bench/results/gpu_check.json as committed in c8bb7fc (the H200 at 3ca5bc3, 2026-11-26 21:53, cut at the call's "
    "600 s in its dag)"
)
H200_DAG = "bench/results/gpu_check.json as committed after 5323907 (the H200, 2026-11-27)"
H200_LOG = "bench/data/gpu/h200-2026-11-26-truth.log"
H200_FIRST = "/work/shared/data/gpu-h200-2026-11-26 (README, gpu_check_run1.json, gpu_check_run2.json)"
FIGURES = {
    "cuda": {
        "device": "NVIDIA H200, torch 2.11.0+cu130 (2026-11-26)",
        # A case's truth: warm-up steps, the stage's probes and the bisection's trials in one process, and the case's
        # share of its section's seconds that no part names (loading, writing).
        "truth_s": {"resnet18": 35, "resnet50": 24, "torchvision.models:vit_b_16": 24},
        "truth_source": f"{H200_RUN}: the sections' seconds less Lightning's and the stage's",
        "lightning_s": {"resnet18": 56, "resnet50": 36, "torchvision.models:vit_b_16": 32},
        "lightning_source": f"{H200_RUN}: lightning.seconds of each case",
        "stage_s": {"one_process": 20, "fresh_processes": 89},
        "stage_source": f"{H200_RUN}: stage.*.seconds of resnet18_32_fp32",
        "launch_s": 13,  # a launched worker's start (torch, CUDA, the model) before its first step
        # One profile measurement in the steptime section's worker: its model's build, then about 40 steps' worth
        # (warm-up, epoch ends with validation and a checkpoint, the measured pairs).
        "measurement": {"fixed_s": 1.0, "steps": 40},
        "measurement_source": f"{H200_DAG}: steptime's measure_wall_s, 0.9 s at 9.4 ms steps to 2.8-3.1 s at 33 ms",
        # Small batches' training steps (b=128 at 32 px, b=32 at 224 px), the trained runs' train_time_s a step.
        "step_s": {"resnet18": 0.011, "resnet50": 0.030, "torchvision.models:vit_b_16": 0.037},
        # A steady step at a batch that fills the device (the truths' warm-up), that larger batches scale from.
        "full_step": {"resnet18": [512, 0.024], "resnet50": [128, 0.030], "torchvision.models:vit_b_16": [128, 0.059]},
        "full_step_source": f"{H200_LOG}: the warm-up's steady steps (resnet18 fp32 at 512, resnet50 bf16 "
        "channels_last and vit_b_16 bf16 at 128)",
        "steps_source": f"{H200_RUN}: steptime 111 s, 18 measurements, 3 x 603 trained steps: 6.6, 18.2 and 22.5 s",
        "dag_s": 85,  # 73 s once scripts/gpu-python.sh compiled the bytecode, 113 s before (the image compiles none)
        "dag_source": f"{H200_DAG}: 73 s at b984bc5; 113 s at cda24c7 (5323907's file); {H200_FIRST}: 151 s",
    },
    "cpu": {
        "device": "this repository's CPU machine, 2 cores (quick scale, 2026-11-26)",
        "truth_s": {"tiny_cnn": 8},
        "truth_source": "bench/gpu_check.py --device cpu --scale quick, 04:27 and 04:32 UTC (the second under load)",
        "lightning_s": {"tiny_cnn": 12},
        "lightning_source": "the same runs with PyTorch Lightning 2.6.6 on PYTHONPATH (25 s under load)",
        "stage_s": {"one_process": 5, "fresh_processes": 33},
        "stage_source": "the same runs (9 s and 84 s under load)",
        "launch_s": 5,
        "measurement": {"fixed_s": 0.4, "steps": 40},
        "measurement_source": "the same runs: about 0.5 s a measurement at 3 ms steps",
        "step_s": {"tiny_cnn": 0.003},
        "steps_source": "the same runs: steptime 19 s, oom 18 s",
        "dag_s": 80,
        "dag_source": "bench/gpu_check.py --device cpu --scale quick --sections dag: 76 s (159 s under load)",
    },
}


def _per_model(table: dict, model: str) -> float:
    """A model's recorded figure; a model never recorded takes the largest (an estimate errs long)."""
    return table.get(model, max(table.values()))


def memory_estimate(spec: dict, figures: dict) -> float:
    total = 0.0
    for case in spec["cases"].values():
        total += _per_model(figures["truth_s"], case["model"])
        total += _per_model(figures["lightning_s"], case["model"]) if case.get("lightning") else 0
        total += sum(figures["stage_s"][way] for way in case.get("stage", []))
    return total


def middle(low: int, high: int) -> int:
    """The profiled batch the steptime section trains: the middle of the doublings from `low` to `high`."""
    grid = doublings(low, high)
    return grid[len(grid) // 2]


def step_estimate(figures: dict, model: str, batch: int) -> float:
    """A step at `batch`: the small batches' launch-bound time, or where the device is busy longer, the recorded
    full step scaled by the batch (a model without a full step recorded: the small batches' time)."""
    small = _per_model(figures["step_s"], model)
    if model not in figures.get("full_step", {}):
        return small
    recorded_batch, seconds = figures["full_step"][model]
    return max(small, seconds * batch / recorded_batch)


def trained_steps(epochs: int, spec: dict | None = None) -> int:
    return epochs * (spec or {}).get("steps_per_epoch", STEPS_PER_EPOCH)


def oom_estimate(spec: dict, figures: dict) -> float:
    """In-process trials at the batch, then the train stage's two launches (the one that runs out, the relaunch that
    trains each step as two slices of half the batch)."""
    full, half = (step_estimate(figures, spec["model"], b) for b in (spec["batch"], spec["batch"] // 2))
    return 2 * figures["launch_s"] + trained_steps(spec["epochs"], spec) * 2 * half + 10 * full


def steptime_estimate(spec: dict, figures: dict) -> float:
    """One launched worker: every round's measurements (each a fixed part and steps at its batch), then each case's
    training."""
    measurement = figures["measurement"]
    one_round = sum(
        measurement["fixed_s"] + measurement["steps"] * step_estimate(figures, case["model"], batch)
        for case in spec["cases"]
        for batch in doublings(case["batch"]["min"], case["batch"]["max"])
    )
    steps = trained_steps(spec["epochs_trained"])
    training = sum(
        steps * step_estimate(figures, case["model"], middle(case["batch"]["min"], case["batch"]["max"]))
        for case in spec["cases"]
    )
    return figures["launch_s"] + spec["rounds"] * one_round + training


def dag_estimate(spec: dict, figures: dict) -> float:
    return figures["dag_s"]


ESTIMATES = {
    "memory": memory_estimate,
    "memory_imagenet": memory_estimate,
    "oom": oom_estimate,
    "steptime": steptime_estimate,
    "dag": dag_estimate,
}


def estimate(section: str, preset: dict, device: str) -> float:
    return ESTIMATES[section](preset[section], FIGURES[device])


def plan(preset: dict, device: str, sections: list[str], budget_s: float | None) -> list[dict]:
    """The sections asked for in order of value, each with its estimate and whether it fits `budget_s` after those
    before it (None: no budget, every section runs)."""
    rows, planned = [], 0.0
    for name in [s for s in VALUE if s in sections]:
        seconds = estimate(name, preset, device)
        fits = budget_s is None or planned + seconds <= budget_s
        rows.append({"section": name, "estimate_s": round(seconds), "runs": fits, "starts_at_s": round(planned)})
        planned += seconds if fits else 0
    return rows


def skip_reason(name: str, seconds: float, elapsed: float, budget_s: float) -> str:
    return (
        f"skipped: its estimate {seconds:.0f} s does not fit the {budget_s - elapsed:.0f} s left of --budget-s "
        f"{budget_s:.0f}"
    )


def plan_text(rows: list[dict], device: str, budget_s: float | None) -> str:
    """The plan as printed before a run and by `make gpu-dry-run`."""
    lines = [f"plan on {device} (estimates from {FIGURES[device]['device']}):"]
    for row in rows:
        when = f"from {row['starts_at_s']:>4} s" if row["runs"] else "skipped: does not fit the budget"
        lines.append(f"  {row['section']:15s} ~{row['estimate_s']:>4} s  {when}")
    total = sum(row["estimate_s"] for row in rows if row["runs"])
    limit = f" of --budget-s {budget_s:.0f}" if budget_s is not None else f" (slot {SLOT_S} s with the wheels)"
    lines.append(f"  total           ~{total:>4} s{limit}")
    return "\n".join(lines)

"""The performance benchmark's jobs: the models it measures, each on its data set, over the same grid (shared by
perf_accuracy's steady steps and whole_run's short runs)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tula_bench.common import bench_job
from tula_bench.perf_replay import MEASUREMENT

if TYPE_CHECKING:
    from tula_hpc.core.job import Job

DIGITS = {"name": "digits", "image_size": 8}  # the default job's data
FASHION_MNIST = {"name": "fashion_mnist", "root": None, "image_size": 14, "augment": "standard"}
# model -> the data set it runs on and the model's arguments
MODELS = {
    "tiny_cnn": {"data": DIGITS, "kwargs": {}},
    "resnet18": {"data": DIGITS, "kwargs": {}},
    "bn_cnn": {"data": FASHION_MNIST, "kwargs": {"width": 16}},
    "cifar_resnet": {"data": FASHION_MNIST, "kwargs": {"width": 8, "blocks": 1}},
    # The language model: made on the device like every synthetic set, so it runs wherever torch does; a
    # step's time does not depend on which tokens it reads. Other sections as the job sets them (`sections`).
    "gpt": {
        "data": {"name": "synthetic", "seq_len": 64, "kwargs": {"vocab": 256}},
        "kwargs": {"layers": 2, "heads": 4, "width": 64},
        "sections": {"train": {"optimizer": "adamw", "strategy": "lbt"}, "task": {"name": "causal_lm"}},
    },
}
NODES = (1, 2)
PER_DEVICE = (8, 512)
# Adaptive search stops on predictions confirmed within this; here it is set to about this machine's noise
# floor (a tighter tolerance cannot be confirmed on it and turns adaptive into full search).
ADAPTIVE = {"tolerance": 0.10, "max_profiles": None}


def bench_jobs(launcher: str) -> dict[str, Job]:
    return {
        model: bench_job(
            as_name=f"bench-{model}",
            launcher=launcher,
            model={"name": model, "kwargs": spec["kwargs"]},
            data=spec["data"],
            search={
                **MEASUREMENT,
                "adaptive": ADAPTIVE,
                "nodes": {"min": NODES[0], "max": NODES[-1]},
                "batch": {"min": PER_DEVICE[0], "max": NODES[-1] * PER_DEVICE[1]},
            },
            objective={"pricing": "node_hour"},
            resources={"time_min": 60},  # the whole pool is one job
            **spec.get("sections", {}),
        )
        for model, spec in MODELS.items()
    }

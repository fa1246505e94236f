"""T and cost of every candidate from a fitted performance model (Eq. 4a): what fit-model writes and what the search
that confirms its decision (search.confirm_choice, in the adapt rule) predicts between its profiles; one home for both.

T = E (the run's length, progress.run_epochs: its last epoch may be part-run) * (steps per epoch of B, the last one
with the rest of the data) * t_step plus what the run spends once (the warm-up W) and once per epoch (c_epoch;
run_overhead.py), the cost by the job's pricing (pricing.py); no step is shorter than the loader's workers take to
make its batch (loader_rate.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from tula_hpc.core.errors import StageError
from tula_hpc.core.run_layout import candidate_devices, last_batch, steps_per_epoch
from tula_hpc.performance.epochs import epoch_times, restarts, run_time
from tula_hpc.performance.estimator import PerfModel
from tula_hpc.performance.fitting import (
    candidate_row,
    estimate_steps,
    fit_profiles,
    leave_one_out,
    measured_steps,
    measurement_weight,
)
from tula_hpc.performance.loader_rate import LoaderRate, fit_loader_rate
from tula_hpc.performance.pricing import charge_factor, costs
from tula_hpc.performance.run_overhead import RunOverheads, fit_overheads, zero_terms
from tula_hpc.training.progress import (
    measured_noise_scale,
    recipe_steps,
    run_epochs,
    steps_to_progress,
    tokens_per_sample,
    whole_epochs,
)

if TYPE_CHECKING:
    from tula_hpc.core.job import Job


def predict_candidates(
    model: PerfModel,
    candidates: list[dict],
    job: Job,
    train_samples: int,
    memory: dict,
    measured: dict[tuple[int, ...], float] | None = None,
    weight: float = 0.0,
    overheads: RunOverheads | None = None,
    loader: LoaderRate | None = None,
) -> list[dict]:
    """T and cost of every candidate, each on its own GPUs per node; a profiled one's step is its measurement
    weighed with the model's (`measured`: model row -> measured step, `weight`: see `measurement_weight`), no
    shorter than its loader's pace (`loader`; none: no floor), the run's warm-up and epoch ends from `overheads`
    (none: steps only)."""
    measured = measured or {}
    objective, tokens = job.objective, tokens_per_sample(job.data)
    partition = job.resources.slurm.partition
    if objective.pricing == "service_units" and charge_factor(objective, partition) is None:
        raise StageError(
            f"job '{job.name}': field 'objective.charge_factors': no factor for partition "
            f"'{partition}' and no 'default'; allowed: add '{partition}: <SU per node-hour>' or 'default'"
        )
    X = np.array([candidate_row(c, candidate_devices(c, job), job.launcher) for c in candidates], float)
    parts = model.predict_parts(X)
    steps = estimate_steps(model, X, measured, weight)
    uncertainty = model.predict_uncertainty(X)
    # Eq. 4a, step by step: an epoch's last step carries only the rest of each rank's share.
    last = X.copy()
    last[:, 1] = [last_batch(train_samples, int(r), int(b)) for r, b in X[:, :2]]
    last_step = model.predict(last) * steps / parts["step_s"]  # the last, smaller step moves by the same factor
    loader = LoaderRate() if loader is None else loader  # no workers: no floor
    loader_s = loader.predict(X[:, 1])
    loader_bound = loader_s > steps
    steps, last_step = np.maximum(steps, loader_s), np.maximum(last_step, loader.predict(last[:, 1]))
    profiled = {tuple(row) for row in model.profiled_.astype(int).tolist()}
    terms = overheads.predict(X, steps) if overheads is not None else zero_terms(len(X))
    rows = []
    for i, c in enumerate(candidates):
        ranks = int(X[i, 0])
        step = float(steps[i])
        per_epoch = steps_per_epoch(train_samples, ranks, c["per_device_batch"])
        once = {term: float(values[i]) for term, values in terms.items()}
        epoch = (per_epoch - 1) * step + float(last_step[i]) + once["epoch_start_s"]  # a steady epoch
        epochs = run_epochs(job.train, train_samples, c["batch"], tokens)  # train.steps: the batch's own
        total = run_time({"epoch_s": epoch, **once}, epochs)
        price = costs(total, c["nodes"], ranks, c["per_device_batch"], objective, memory, partition)
        rows.append(
            {
                **c,
                "ranks": ranks,
                "ranks_per_host": int(X[i, 2]),
                "profiled": tuple(X[i].astype(int).tolist()) in profiled,
                **{part: float(values[i]) for part, values in parts.items()},
                "model_step_s": float(parts["step_s"][i]),
                "loader_s": float(loader_s[i]),
                "loader_bound": bool(loader_bound[i]),
                "step_s": step,
                "steps_per_epoch": per_epoch,
                "epoch_s": epoch,
                **once,
                "warmup_s": once["warmup_first_s"] + once["warmup_second_s"],
                "first_epoch_s": epoch_times({"epoch_s": epoch, **once}, 1)[0],
                "run_epochs": epochs,
                "time_s": total,
                "job_time_s": total + whole_epochs(epochs) * once["outside_epoch_s"],
                "rel_uncertainty": float(uncertainty[i]),
                "time_s_range": [total * (1 - uncertainty[i]), total * (1 + uncertainty[i])],
                "costs": price,
                "cost": price[objective.pricing],
            }
        )
    return rows


def fit_and_predict(
    job: Job,
    profiles: list[dict],
    candidates: list[dict],
    train_samples: int,
    memory: dict,
    settings: dict,
    overheads: RunOverheads | None = None,
    loader: LoaderRate | None = None,
) -> tuple[PerfModel, list[float], float, list[dict]]:
    """The model fitted to `profiles`, its leave-one-out errors, the weight of a profiled candidate's own
    measurement, and T and cost of every candidate: the stage's whole computation, short of files. `overheads`:
    the run's warm-up and epoch ends, `loader`: its loader's pace (defaults: fitted to `profiles`)."""
    model = fit_profiles(profiles, **settings)
    loo = leave_one_out(profiles, **settings)
    weight = measurement_weight(loo, job.search.noise_prior)
    overheads = fit_overheads(profiles) if overheads is None else overheads
    loader = fit_loader_rate(profiles) if loader is None else loader
    rows = predict_candidates(
        model, candidates, job, train_samples, memory, measured_steps(profiles), weight, overheads, loader
    )
    noise = measured_noise_scale(profiles)
    if noise is not None:
        to_progress(rows, job, train_samples, noise["b_noise"])
    return model, loo, weight, rows


def to_progress(rows: list[dict], job: Job, train_samples: int, b_noise: float) -> None:
    """Each candidate's steps, epochs, time and cost to the recipe's progress (train.epochs at train.lr_base_batch)
    at the measured noise scale (progress.steps_to_progress): what the goodput objectives compare. Time is
    the steps times the predicted step, the warm-up and an epoch start for every epoch the steps run into after the
    first; cost scales with time under every pricing."""
    base_steps = recipe_steps(job.train, train_samples, tokens_per_sample(job.data))
    for row in rows:
        steps = steps_to_progress(base_steps, b_noise, job.train.lr_base_batch, row["batch"])
        epochs = steps / row["steps_per_epoch"]
        time_s = steps * row["step_s"] + row["warmup_s"] + restarts(epochs) * row["epoch_start_s"]
        row.update(
            progress_steps=steps,
            progress_epochs=epochs,
            progress_time_s=time_s,
            progress_cost=row["cost"] * time_s / row["time_s"],
        )

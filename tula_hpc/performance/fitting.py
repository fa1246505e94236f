"""The performance model fitted to profiles, and what it says of candidates: a profile's or a candidate's model row,
the fit settings from the job, the fit itself, its leave-one-out errors, and a candidate's step with a profiled one's
own measurement weighed in (`measurement_weight`). The estimator is estimator.py's.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import numpy as np
from sklearn.base import clone
from sklearn.exceptions import FitFailedWarning
from sklearn.model_selection import LeaveOneOut, cross_validate

from tula_hpc.core.plain_data import to_plain
from tula_hpc.core.run_layout import ranks_per_host
from tula_hpc.performance.estimator import PerfModel

if TYPE_CHECKING:
    from tula_hpc.core.job import Job


def model_row(ranks: int, per_device_batch: int, ranks_per_host: int) -> list[float]:
    """The model's input row: X = [[ranks, per_device_batch, ranks_per_host], ...]."""
    return [ranks, per_device_batch, ranks_per_host]


def profile_row(profile: dict) -> list[float]:
    """The input row of a profile record (profile/N{n}_B{b}.json)."""
    return model_row(profile["world_size"], profile["per_device_batch"], profile["ranks_per_host"])


def candidate_row(candidate: dict, devices_per_node: int, launcher: str) -> list[float]:
    """The input row of a plan's candidate {"nodes", "per_device_batch", ...} under this launcher, with
    `devices_per_node` the candidate's own (layout.candidate_devices: GPUs per node is a choice too)."""
    nodes = candidate["nodes"]
    return model_row(
        nodes * devices_per_node, candidate["per_device_batch"], ranks_per_host(launcher, nodes, devices_per_node)
    )


def model_params(job: Job) -> dict:
    """Fit settings from the job's `search` section (PerfModel's parameters and how profiles are weighed), as plain
    data: the sync prior a dict, as PerfModel takes it and the benches write it to JSON."""
    search = job.search
    return {
        "collective": search.collective,
        "sync_fit": search.sync_fit,
        "sync_prior": to_plain(search.sync_prior),
        "noise_prior": search.noise_prior,
        "discrepancy_per_octave": search.discrepancy_per_octave,
        "interference_tolerance": search.interference_tolerance,
    }


def fit_profiles(profiles: list[dict], interference_tolerance: float = 0.1, **model_params) -> PerfModel:
    """Fit a PerfModel to profile records (profile/N{n}_B{b}.json contents).

    Profiles that other work kept disturbed (interference above the tolerance even after re-measuring)
    land several times farther from the truth than quiet ones, so they weigh as much less: half at the
    tolerance, a tenth at three times it. This matters only where profiles are to spare.
    """
    model, X, y, fit_params = _fit_inputs(profiles, interference_tolerance, **model_params)
    return model.fit(X, y, **fit_params)


def _fit_inputs(profiles: list[dict], interference_tolerance: float = 0.1, **model_params):
    """The unfitted model, X, y and fit's metadata (split parts, weights) of profile records."""
    X = np.array([profile_row(p) for p in profiles], float)
    weight = [1.0 / (1.0 + (p.get("interference", 0.0) / interference_tolerance) ** 2) for p in profiles]
    fit_params = {name: np.asarray(v, float) for name, v in profile_parts(profiles).items()}
    model = PerfModel(grad_bytes=profiles[0]["grad_bytes"], **model_params)
    return (
        model,
        X,
        np.array([p["median"]["step_s"] for p in profiles]),
        {**fit_params, "sample_weight": np.array(weight)},
    )


def profile_parts(profiles: list[dict]) -> dict[str, list[float]]:
    """The split parts every profile holds, as PerfModel.fit takes them: a profile of the overlapped step alone
    (no sync_s) makes sync latent."""
    med = [p["median"] for p in profiles]
    parts = {}
    if all("data_s" in m for m in med):
        parts["data_s"] = [m["data_s"] for m in med]
    if all("compute_s" in m for m in med):
        parts["compute_s"] = [m["compute_s"] + m.get("update_s", 0.0) for m in med]
    if all("sync_s" in m for m in med):
        parts["sync_s"] = [m["sync_s"] for m in med]
    return parts


def _held_out_error(model: PerfModel, X, y) -> float:
    return float(abs(model.predict(X)[0] / y[0] - 1))


def leave_one_out(profiles: list[dict], **model_params) -> list[float]:
    """Relative step-time error on each profile left out, where the rest still identify the model the same way
    (scikit-learn's LeaveOneOut; a fold whose rest cannot be fitted at all counts as not identifying it)."""
    if len(profiles) < 2:
        return []
    model, X, y, fit_params = _fit_inputs(profiles, **model_params)
    identified = clone(model).fit(X, y, **fit_params).identified_
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FitFailedWarning)
        folds = cross_validate(
            model, X, y, cv=LeaveOneOut(), params=fit_params, scoring=_held_out_error, return_estimator=True
        )
    return [
        float(error)
        for error, fitted in zip(folds["test_score"], folds["estimator"])
        if getattr(fitted, "identified_", None) == identified
    ]


def measurement_weight(out_of_sample: list[float], noise: float) -> float:
    """How much a profiled candidate's own measured step counts against the model's prediction of it.

    Inverse-variance weighting of two estimates of the same step time: the model's, off by its
    out-of-sample (leave-one-out) error, and the measurement's, off by the profile noise. Real step times
    have structure no few-parameter model follows (kernel choice by shape, caches), so with spare profiles
    the measurement mostly wins; with none spare the model passes through its profiles and the weight is moot.
    """
    if not out_of_sample:
        return 0.0
    model_variance = float(np.mean(np.square(out_of_sample)))
    return model_variance / (model_variance + noise**2)


def measured_steps(profiles: list[dict]) -> dict[tuple[int, ...], float]:
    """Model row (ranks, per-device batch, ranks per host) -> measured median step of each profile, as
    `estimate_steps` takes them: 2 nodes x 2 GPUs and 4 nodes x 1 GPU share ranks and batch, not the row."""
    return {tuple(map(int, profile_row(p))): p["median"]["step_s"] for p in profiles}


def estimate_steps(model: PerfModel, X, measured: dict[tuple[int, ...], float], weight: float) -> np.ndarray:
    """Step times for rows X: the model's, moved by `weight` toward the measurement where the row was profiled."""
    X = np.asarray(X, float).reshape(-1, 3)
    steps = model.predict(X)
    for i, row in enumerate(map(tuple, X.astype(int).tolist())):
        if row in measured:
            steps[i] += weight * (measured[row] - steps[i])
    return steps

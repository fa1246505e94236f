"""How fast a rank's DataLoader workers make batches: a floor under the step time that a profile's steps cannot show.

With W loader workers a batch is made in a worker while the steps before it run, and up to 2W are made ahead (the
prefetch). A profile's few measured steps draw on that queue, filled while it timed the epoch ends, so its data part
holds only the hand-over; in a whole epoch a loader slower than the step sets the pace, one batch every
worker_batch_s / W. On the H200 at 3ca5bc3, where three workers drew 224 px synthetic images on the host, resnet50's
first epoch at b=32 ran 28 % slower than its profile's steps predicted (27 against 20.4 ms a step), while resnet18's
32 px images, 49 times fewer pixels, kept within 1 % (bench/data/gpu/whole_run).

So each profile also times one batch made as a worker makes it (step_timing.worker_batch_s: the data set's items and
the collate, on one thread), and t_step = max(the performance model's step, (a + c x b) / W) at per-device batch b,
a and c non-negative: a line through the profiled batches (proportional to b with one batch). Without workers,
loading is the step's own data part and no floor applies; profiles recorded before it was timed (or a replayed trace)
give none either, and the notes say so.
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import nnls
from sklearn.base import BaseEstimator


def profile_loader(profile: dict) -> tuple[int, float] | None:
    """(workers, seconds one worker takes for a batch) a profile timed; None where it timed none."""
    loader = profile.get("loader")
    return (loader["workers"], loader["worker_batch_s"]) if loader else None


class LoaderRate(BaseEstimator):
    """The least time a step takes at per-device batch b because its loader's `workers` make one batch every
    (intercept_s_ + per_sample_s_ x b) / workers seconds (0 without workers or profiles that timed them)."""

    def __init__(self, workers: int = 0):
        self.workers = workers

    def fit(self, X, y) -> LoaderRate:
        """X: per-device batches; y: seconds one worker took to make a batch of each."""
        b, seconds = np.asarray(X, float).reshape(-1), np.asarray(y, float).reshape(-1)
        self.intercept_s_, self.per_sample_s_ = 0.0, 0.0
        if len(set(b.tolist())) >= 2:
            (self.intercept_s_, self.per_sample_s_), _ = nnls(np.column_stack([np.ones_like(b), b]), seconds)
        elif len(b):
            self.per_sample_s_ = float(np.median(seconds / b))
        self.intercept_s_, self.per_sample_s_ = float(self.intercept_s_), float(self.per_sample_s_)
        return self

    def predict(self, X) -> np.ndarray:
        """The floor of a step at each per-device batch in X."""
        b = np.asarray(X, float).reshape(-1)
        if not self.workers:
            return np.zeros_like(b)
        return (self.intercept_s_ + self.per_sample_s_ * b) / self.workers

    def coefficients(self) -> dict:
        """The fitted line, as perfmodel.json records it."""
        return {"workers": self.workers, "intercept_s": self.intercept_s_, "per_sample_s": self.per_sample_s_}


def fit_loader_rate(profiles: list[dict]) -> tuple[LoaderRate, list[str]]:
    """LoaderRate fitted to the profile records that timed their loader, and notes where none did."""
    timed = [(p["per_device_batch"], *found) for p in profiles if (found := profile_loader(p)) is not None]
    if not timed:
        note = (
            "no profile timed its loader's workers (profiles recorded before they were timed, or a replayed trace): "
            "no step is held to the loader's pace; profile again to count it"
        )
        return LoaderRate().fit([], []), [note] if any("loader" not in p for p in profiles) else []
    batches, workers, seconds = zip(*timed)
    return LoaderRate(workers=max(workers)).fit(batches, seconds), []

"""How fast a rank's DataLoader workers make batches: a floor under the step time that a profile's steps cannot show.

With W loader workers a batch is made in a worker while the steps before it run, and 2W are asked for ahead (the
prefetch). A profile's few measured steps draw on batches the workers made while it timed the epoch ends, so its data
part holds only the hand-over; in a whole epoch a loader slower than the step sets the pace. On the H200 at 3ca5bc3,
where three workers drew 224 px synthetic images on the host, resnet50's first epoch at b=32 ran 28 % slower than its
profile's steps predicted (27 against 20.4 ms a step), while resnet18's 32 px images, 49 times fewer pixels, kept
within 1 % (bench/data/gpu/whole_run); bench/loader_pace.py shows the same on the CPU.

So each profile also times the loader alone (step_timing's `loader_period_s`: the seconds between a fresh epoch's
batches, nothing else asked of the host), and t_step = max(the performance model's step, a + c x b) at per-device
batch b, a and c non-negative: a line through the profiled batches (proportional to b with one batch). Without
workers, loading is the step's own data part and no floor applies; profiles recorded before the loader was timed (or
a replayed trace) give none either, and the notes say so.
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import nnls
from sklearn.base import BaseEstimator


class LoaderRate(BaseEstimator):
    """The least time a step takes at per-device batch b because its loader's `workers` make a batch every
    intercept_s_ + per_sample_s_ x b seconds (no floor without workers)."""

    def __init__(self, workers: int = 0):
        self.workers = workers

    def fit(self, X, y, *, untimed: int = 0) -> LoaderRate:
        """X: per-device batches; y: the seconds between the loader's batches at each; `untimed`: profiles recorded
        before the loader was timed (or a replayed trace's), which hold no floor (`notes_` says so where none did)."""
        b, seconds = np.asarray(X, float).reshape(-1), np.asarray(y, float).reshape(-1)
        intercept, per_sample = 0.0, 0.0
        if len(set(b.tolist())) >= 2:
            (intercept, per_sample), _ = nnls(np.column_stack([np.ones_like(b), b]), seconds)
        elif len(b):
            per_sample = np.median(seconds / b)
        self.intercept_s_, self.per_sample_s_ = float(intercept), float(per_sample)
        self.notes_ = []
        if untimed and not len(b):
            self.notes_.append(
                "no profile timed its loader (profiles recorded before it was timed, or a replayed trace): no step is "
                "held to the loader's pace; profile again to count it"
            )
        return self

    def predict(self, X) -> np.ndarray:
        """The floor of a step at each per-device batch in X."""
        b = np.asarray(X, float).reshape(-1)
        if not self.workers:
            return np.zeros_like(b)
        return self.intercept_s_ + self.per_sample_s_ * b

    def coefficients(self) -> dict:
        """The fitted line, as perfmodel.json records it."""
        return {"workers": self.workers, "intercept_s": self.intercept_s_, "per_sample_s": self.per_sample_s_}


def fit_loader_rate(profiles: list[dict]) -> LoaderRate:
    """LoaderRate fitted to profile records (profile/N{n}_B{b}.json contents): those that timed their loader (a
    record without workers holds `loader: null`)."""
    timed = [
        (p["per_device_batch"], p["loader"]["workers"], p["loader"]["period_s"]) for p in profiles if p.get("loader")
    ]
    batches, workers, seconds = zip(*timed) if timed else ((), (0,), ())
    return LoaderRate(workers=max(workers)).fit(batches, seconds, untimed=sum("loader" not in p for p in profiles))

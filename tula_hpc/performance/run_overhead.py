"""What a training run spends once per run and once per epoch beside its steps: the warm-up W and the epoch-end
terms, from what each profile timed (step_timing: `warmup_step_s`, `epoch_ends`).

    T = W_1 + W_2 + E x ((S - 1) x t + t_last) + (E - 1) x c_epoch     the span of train's epoch_time_s (train_time_s)

- W_1 lands in the first epoch: the warm-up steps' time over the steady step t, and the epoch's last, shorter step
  over a later one (its shape's first time). On a GPU the first step of a process builds cuDNN and cuBLAS plans and
  fills the allocator's cache: 945 ms, then 39 ms, then 24 ms steady for resnet18 32 px at b=512 on the H200
  (bench/data/gpu/resnet18_32_fp32.json; vit_b_16 224 px bf16 at b=128: 942, 59, 59 ms), so the first step's
  excess and the next ones' are counted, not a fixed number of discarded steps. The loader's first start is in it.
- W_2 lands in the second epoch: the first epoch start over a later one (AGS's update step on a split batch runs
  there first, at shapes of its own: the H200's second epoch took 0.52 s against 0.155 s for the third).
- c_epoch: a steady epoch start (the loader's restart and the epoch's first step, AGS's update step) less one steady
  step. The first epoch's start is in W_1: E - 1 of them.
- outside_epoch_s: the strategy's epoch end, validation and the checkpoint, every epoch, outside epoch_time_s (so
  outside T and what evaluate compares); the job's wall time (the Slurm limit) adds E of them.

Each term is the profile's measurement at a profiled configuration and a + b x (what it depends on) elsewhere, a and
b non-negative: the warm-ups and c_epoch on the predicted step (plans and passes that scale with the step's work),
the outside term on 1 / ranks (validation is split over the ranks). With fewer than MIN_PROFILES profiles holding a
term at distinct values, it is their median. A term no profile holds (profiles recorded before these were timed, a
replayed trace) is 0, and the notes say so.
"""

from __future__ import annotations

import statistics

import numpy as np
from scipy.optimize import nnls
from sklearn.base import BaseEstimator

from tula_hpc.performance.fitting import profile_row

TERMS = ("warmup_first_s", "warmup_second_s", "epoch_start_s", "outside_epoch_s")
ON_STEP = ("warmup_first_s", "warmup_second_s", "epoch_start_s")  # the rest: on 1 / ranks
MIN_PROFILES = 3


def profile_terms(profile: dict) -> dict[str, float]:
    """The terms one profile record measured (none of a record without warm-up or epoch-end timings)."""
    step, terms = profile["median"]["step_s"], {}
    warmup, ends = profile.get("warmup_step_s"), profile.get("epoch_ends")
    if warmup:
        terms["warmup_first_s"] = sum(w - step for w in warmup)
    if ends:
        last, start = ends["last_step_s"], ends["start_s"]
        if "warmup_first_s" in terms:
            terms["warmup_first_s"] += last[0] - last[-1]
        terms["warmup_second_s"] = start[0] - start[-1]
        terms["epoch_start_s"] = start[-1] - step
        terms["outside_epoch_s"] = ends["strategy_end_s"][-1] + ends["validation_s"][-1] + ends["checkpoint_s"]
    return {name: max(0.0, value) for name, value in terms.items()}


def _line(x: np.ndarray, y: np.ndarray, min_points: int) -> tuple[float, float]:
    """(a, b) of y = a + b x, non-negative, least squares; the median and 0 with fewer than `min_points` distinct x."""
    if len(set(x.tolist())) < min_points:
        return float(np.median(y)), 0.0
    (a, b), _ = nnls(np.column_stack([np.ones_like(x), x]), y)
    return float(a), float(b)


class RunOverheads(BaseEstimator):
    """TERMS at rows X = [[ranks, per_device_batch, ranks_per_host], ...] with their step times: the profile's own
    measurement where profiled (`measured_`), `coef_[term]` = (a, b) elsewhere."""

    def __init__(self, min_profiles: int = MIN_PROFILES):
        self.min_profiles = min_profiles

    @staticmethod
    def _feature(term: str, X: np.ndarray, step_s: np.ndarray) -> np.ndarray:
        return step_s if term in ON_STEP else 1.0 / X[:, 0]

    def fit(self, X, y=None, *, step_s, terms: list[dict[str, float]]) -> RunOverheads:
        """`terms`: each row's measured terms (profile_terms); `step_s`: each row's measured step."""
        X, step_s = np.asarray(X, float).reshape(-1, 3), np.asarray(step_s, float)
        self.measured_, self.coef_, self.notes_ = {}, {}, []
        for term in TERMS:
            rows = [i for i, measured in enumerate(terms) if term in measured]
            by_row: dict[tuple[int, ...], list[float]] = {}
            for i in rows:
                by_row.setdefault(tuple(X[i].astype(int).tolist()), []).append(terms[i][term])
            self.measured_[term] = {row: statistics.fmean(values) for row, values in by_row.items()}
            values = np.array([terms[i][term] for i in rows])
            feature = self._feature(term, X[rows], step_s[rows])
            self.coef_[term] = _line(feature, values, self.min_profiles) if rows else (0.0, 0.0)
        missing = [term for term in TERMS if not self.measured_[term]]
        if missing:
            self.notes_.append(
                f"no profile timed {', '.join(missing)} (profiles recorded before warm-up and epoch ends were "
                f"timed, or a replayed trace): held at 0, so T counts steps only there; profile again to count them"
            )
        return self

    def predict(self, X, step_s) -> dict[str, np.ndarray]:
        """Each term at rows X whose steps take `step_s`: measured where profiled, modelled elsewhere."""
        X, step_s = np.asarray(X, float).reshape(-1, 3), np.asarray(step_s, float)
        out = {}
        for term in TERMS:
            a, b = self.coef_[term]
            values = a + b * self._feature(term, X, step_s)
            for i, row in enumerate(map(tuple, X.astype(int).tolist())):
                values[i] = self.measured_[term].get(row, values[i])
            out[term] = values
        return out

    def coefficients(self) -> dict:
        """The fitted lines by term, as perfmodel.json records them."""
        return {
            term: {"intercept_s": a, "slope": b, "on": "step_s" if term in ON_STEP else "1/ranks"}
            for term, (a, b) in self.coef_.items()
        }


def fit_overheads(profiles: list[dict]) -> RunOverheads:
    """RunOverheads fitted to profile records (profile/N{n}_B{b}.json contents)."""
    return RunOverheads().fit(
        [profile_row(p) for p in profiles],
        step_s=[p["median"]["step_s"] for p in profiles],
        terms=[profile_terms(p) for p in profiles],
    )


def zero_terms(rows: int) -> dict[str, np.ndarray]:
    """Every term 0: steps only (no profile timed them)."""
    return {term: np.zeros(rows) for term in TERMS}

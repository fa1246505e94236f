"""The parallel performance model of paper Eq. 2, a scikit-learn estimator (fitting.py fits it to profiles).

    t_step(N, b, h) = data(b) + ((compute(b, h) (1 + i))^g + sync(N, h)^g)^(1/g)  overlap of Pollux, see below
    data(b)         = d0 + d1 * b                                  loading, linear in b
    compute(b, h)   = (a0 + a1 * (b - b0) + (h - 1) * (c0 + c1 * (b - b0))) * k(b)   forward+backward+update (Eq. 2b)
    sync(N, h)      = intra(h) + inter(H) * l(H),  H = N / h hosts  per collective (Eq. 2c), 0 on one rank
        each part   = alpha * hops(n) + beta * bytes(n) of the collective among its n peers, with its own
                      alpha (seconds per hop) and beta (seconds per byte): intra among the h ranks of a host,
                      inter among the H hosts
        ring:             hops = 2(n-1), bytes = 2(n-1)/n * gradient bytes
        parameter_server: hops = 2,      bytes = 2n * gradient bytes
    l(H)            = 1, or a host count's own level where its profiles agree on one (`inter_sync_levels_`)
    i               = 0 on one rank; on more, the slowdown the all-reduce beside it brings to compute
                      (`interference_`, fitted with a latent sync only: collective_cost.py)

N is the number of ranks, b the per-device batch (b0 the smallest profiled one, so a0 is the compute
time there and may stay non-negative when compute grows faster than linearly: a line through the
profiles of a convex curve crosses zero before b = 0; below b0 compute is held no lower than the chord
compute(b0, h) * b / b0, so that it stays positive down to b = 1), h the ranks sharing one host. On a cluster h is the
devices per node and constant; with the local launcher all N "nodes" share this machine, and each rank
computes slower the more ranks compete for its cores: the (h - 1) terms model that honestly instead of
pooling one- and two-rank timings into one line. k(b) is 1 unless the profiles hold compute at
KINK_MIN_BATCHES or more batches: then it passes the line through each profiled batch's measured compute and
interpolates between them in log b (GPU kernels change with the batch: kinks one line would cut across), where
the profiles show kinks: neighbours predict each inner batch better than the line does (`kinks_predict_better`).

DDP all-reduces gradient buckets while backward still computes the rest, so the longer backward (the
larger b) the more of sync it hides: a constant exposed share of sync over-predicts large-b, large-N
steps. Pollux's smooth maximum (Qiao et al., OSDI 2021) follows it with one coefficient g (`overlap_gamma_`):
g = 1 exposes all of sync (compute + sync, as Eq. 2 adds them), g -> infinity hides the shorter behind the
longer (max), and in between the exposed part (the combination less compute) shrinks as compute outgrows
sync. g may fall below 1 (to OVERLAP_GAMMA_BOUNDS[0]): on CPUs gloo's all-reduce threads slow the compute
they run beside, so a step can cost more than compute + sync.

Every coefficient is non-negative. Fits minimise relative error (a 2 ms step matters as much as a 2 s
one), down-weight outlying profiles when there are spare ones (Huber), and report which coefficients
the profiles identify. Each part is fitted from the timings that hold it alone, so that none stands in for
another: compute from the split steps' compute parts and the full steps on one rank (nothing to overlap),
sync from the split steps' sync parts, and g, all that the overlapped multi-rank full steps are left to
decide, from those; g says how the overlap grows with b only when they hold two per-device batches. Each
kind of sync is fitted from the profiles that hold it: intra from syncs that stay on one host, inter from
syncs that span hosts (less their intra part). With one size of a kind (one h, or one H) its latency and
bandwidth are collinear, so latency is held at its prior and only bandwidth is fitted; a kind no profile
holds keeps both priors (`sync_prior`, the job's search.sync_prior). A profiled candidate's t_step weighs
its own measurement against the model by their errors (`measurement_weight`).

How sync is laid out over hosts, how it overlaps compute, and its latent fit: collective_cost.py.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.optimize import minimize_scalar, nnls
from sklearn.base import BaseEstimator, RegressorMixin
from sklearn.utils.validation import check_array, check_is_fitted, check_X_y

from tula_hpc.performance.collective_cost import (
    OVERLAP_GAMMA_BOUNDS,
    fit_latent_sync,
    hierarchical_sync_features,
    hosts_spanned,
    identified_columns,
    identified_subset,
    inter_sync_levels,
    overlapped,
)
from tula_hpc.performance.sync_priors import SYNC_KINDS, SYNC_PRIORS

HUBER_K = 1.5
MIN_ROBUST_SCALE = 0.01
COMPUTE_TERMS = ("intercept_s_", "per_sample_s_", "contention_s_", "contention_per_sample_s_")
# g of a latent sync that the profiles hold at one per-device batch only (then g and sync are confounded).
LATENT_GAMMA_PRIOR = 2.0
KINK_MIN_BATCHES = 3
# How much better than the line the neighbours must predict each inner batch's compute for kinks to be followed:
# chosen on both benches at once, the CPU's (10 % noise: 0.7 keeps its figures as they were, 1.0 lost 0.8 points
# of full search's median) and the GPU traces' (full search's leave-one-out median 5.3 % without kinks, 5.0 %).
KINK_MARGIN = 0.7
# Fits of sync's line at most, each without one more host count found to hold a level of its own.
LEVEL_ROUNDS = 3
# How sync is fitted: "auto" splits where the profiles hold sync parts, else latent (see the module's docstring).
SYNC_FITS = ("auto", "split", "latent")
SYNC_TERMS = tuple(f"{kind}_{term}" for kind in SYNC_KINDS for term in ("latency_s", "seconds_per_byte"))
# How notes name a kind's size, and why a kind is missing from the profiles.
SYNC_KIND_TEXT = {
    "intra_node": ("{} ranks on one host", "no multi-rank profile stays on one host"),
    "inter_node": ("{} hosts", "no profile spans two hosts"),
}


def _huber(residual: np.ndarray) -> np.ndarray:
    """Huber weights of residuals, their spread from the median absolute residual."""
    spread = max(1.4826 * np.median(np.abs(residual)), MIN_ROBUST_SCALE)
    return np.minimum(1.0, HUBER_K * spread / np.maximum(np.abs(residual), 1e-12))


def _robust_rounds(robust: bool, rows: int, coefficients: int) -> int:
    """Huber re-weighting rounds: only with rows to spare, else every row is needed as it is."""
    return 6 if robust and rows > coefficients + 1 else 1


def _relative_nnls(A: np.ndarray, y: np.ndarray, weight: np.ndarray, robust: bool, noise_prior: float):
    """Non-negative least squares on relative residuals; Huber re-weighting when rows are to spare.

    Returns the coefficients and their covariance (noise from the residuals, never below the prior).
    """
    n, p = A.shape
    scale = np.sqrt(weight) / y
    huber = np.ones(n)
    for _ in range(_robust_rounds(robust, n, p)):
        w = np.sqrt(huber) * scale
        coef, _ = nnls(A * w[:, None], y * w)
        residual = (A @ coef - y) / y
        huber = _huber(residual)
    w = np.sqrt(huber) * scale
    noise = noise_prior**2
    if n > p:
        noise = max(noise, float(np.sum(huber * weight * residual**2) / (n - p)))
    scaled = A * w[:, None]
    return coef, noise * np.linalg.pinv(scaled.T @ scaled)


def kinks_predict_better(knots: np.ndarray, ratios: np.ndarray) -> bool:
    """Whether the profiles show kinks: each inner batch's measured compute over the line (`ratios`) is
    predicted better from its neighbours' (interpolated in log b) than by the line itself, on average. Noise
    that the line averages out predicts its neighbours worse than the line does; a kink predicts them better."""
    inner = range(1, len(knots) - 1)
    from_neighbours = [
        abs(ratios[k] - np.interp(knots[k], knots[[k - 1, k + 1]], ratios[[k - 1, k + 1]])) for k in inner
    ]
    return float(np.mean(from_neighbours)) < KINK_MARGIN * float(np.mean(np.abs(ratios[1:-1] - 1)))


class PerfModel(BaseEstimator, RegressorMixin):
    """Step time of DDP training from X = [[ranks, per_device_batch, ranks_per_host], ...].

    `fit` takes the measured full step times as y and the split parts of the same profiles; `predict`
    gives step times, `predict_parts` the parts, `predict_uncertainty` a relative standard deviation that
    grows with the distance (in octaves of b and N) to the nearest profiled configuration.
    """

    def __init__(
        self,
        grad_bytes: float = 0.0,
        collective: str = "ring",
        sync_prior: dict | None = None,
        noise_prior: float = 0.03,
        discrepancy_per_octave: float = 0.02,
        robust: bool = True,
        sync_fit: str = "auto",
    ):
        self.grad_bytes = grad_bytes
        self.collective = collective
        self.sync_prior = sync_prior
        self.noise_prior = noise_prior
        self.discrepancy_per_octave = discrepancy_per_octave
        self.robust = robust
        self.sync_fit = sync_fit

    # -- design -------------------------------------------------------------------------------------
    def _all_compute_columns(self, batch, extra_ranks) -> np.ndarray:
        """One column per COMPUTE_TERMS entry."""
        beyond = batch - self.batch_ref_
        return np.column_stack([np.ones_like(batch), beyond, extra_ranks, extra_ranks * beyond])

    def _compute_design(self, batch, extra_ranks) -> np.ndarray:
        return self._all_compute_columns(batch, extra_ranks)[:, self.compute_columns_]

    def _compute(self, batch, extra_ranks) -> np.ndarray:
        """Compute by the line, held below b0 no lower than the chord to the origin: no batch smaller than the
        profiles computes a sample faster than b0 does, and a line steeper than that (compute growing faster than
        linearly) would cross zero there, a negative compute no overlap can take (an epoch's small last step)."""
        batch = np.asarray(batch, float)
        coef = np.array([getattr(self, name) for name in COMPUTE_TERMS])
        line = self._all_compute_columns(batch, extra_ranks) @ coef
        at_ref = self._all_compute_columns(np.full_like(batch, self.batch_ref_), extra_ranks) @ coef
        line = np.maximum(line, at_ref * np.minimum(batch / self.batch_ref_, 1.0))
        knots, ratios = self.compute_kinks_
        return line * np.interp(np.log2(np.asarray(batch, float)), knots, ratios)

    def _step_compute(self, ranks, batch, ranks_per_host) -> np.ndarray:
        """Compute as a step runs it: slowed by interference where an all-reduce runs beside it."""
        slowed = np.where(np.asarray(ranks, float) > 1, 1 + self.interference_, 1.0)
        return self._compute(batch, np.asarray(ranks_per_host, float) - 1) * slowed

    def _sync_features(self, ranks, ranks_per_host) -> np.ndarray:
        return hierarchical_sync_features(ranks, ranks_per_host, self.grad_bytes, self.collective)

    def _sync_parts(self, ranks, ranks_per_host) -> tuple[np.ndarray, np.ndarray]:
        """(intra, inter) sync of the fitted line, the host counts' own levels aside."""
        features = self._sync_features(ranks, ranks_per_host)
        return features[:, :2] @ self.sync_coef_[:2], features[:, 2:] @ self.sync_coef_[2:]

    def _sync(self, ranks, ranks_per_host) -> np.ndarray:
        intra, inter = self._sync_parts(ranks, ranks_per_host)
        hosts = hosts_spanned(ranks, ranks_per_host)
        return intra + inter * np.array([self.inter_sync_levels_.get(int(h), 1.0) for h in hosts])

    def _data(self, batch) -> np.ndarray:
        return self.data_coef_[0] + self.data_coef_[1] * np.asarray(batch, float)

    # -- fitting ------------------------------------------------------------------------------------
    def fit(self, X, y, *, data_s=None, compute_s=None, sync_s=None, sample_weight=None) -> PerfModel:
        """Fit to measured full steps y; the split parts (data, compute, sync) of the same profiles are metadata.

        Without sync_s (profiles that hold the overlapped step alone), or with sync_fit "latent", sync is latent:
        fitted with g to the multi-rank full steps (`sync_fit_` "latent"), as Pollux fits it; with sync_s, each
        part from its own timings ("split"). Without data_s loading is taken as 0 (a step time that excludes it).
        """
        X, y = check_X_y(X, y, dtype=float, y_numeric=True)
        if X.shape[1] != 3:
            raise ValueError(f"X has {X.shape[1]} columns; expected 3: ranks, per_device_batch, ranks_per_host")
        self.n_features_in_ = 3
        batch = X[:, 1]
        weight = np.ones_like(y) if sample_weight is None else np.asarray(sample_weight, float)
        data_s = np.zeros_like(y) if data_s is None else np.asarray(data_s, float)
        self.profiled_ = X.copy()
        self.batch_ref_ = float(batch.min())
        self.identified_ = {}
        self.notes_ = []
        self.interference_ = 0.0
        if self.sync_fit not in SYNC_FITS:
            raise ValueError(f"unknown sync_fit {self.sync_fit!r}; allowed: {', '.join(SYNC_FITS)}")
        if self.sync_fit == "split" and sync_s is None:
            raise ValueError("sync_fit 'split' needs sync_s, the profiles' sync parts; 'latent' fits without them")
        self.sync_fit_ = "split" if sync_s is not None and self.sync_fit != "latent" else "latent"

        data_design = np.column_stack([np.ones_like(batch), batch])
        self.data_coef_, self.data_cov_ = _relative_nnls(
            data_design, np.maximum(data_s, 1e-9), weight, self.robust, self.noise_prior
        )
        self._fit_compute(X, y, compute_s, weight)
        self._fit_sync_and_levels(X, y, weight, None if sync_s is None else np.asarray(sync_s, float))
        residual = (self.predict(X) - y) / y
        self.rms_rel_error_ = float(np.sqrt(np.mean(residual**2)))
        return self

    def _fit_compute(self, X, y, compute_s, weight) -> None:
        """Compute from the measured compute parts (when given) and the full steps on one rank (nothing to
        overlap there); contention terms only when the profiles see more than one host load."""
        batch, per_host = X[:, 1], X[:, 2]
        single = X[:, 0] == 1
        self.compute_columns_ = [0, 1] + ([2, 3] if len(set(per_host)) > 1 else [])
        parts = np.arange(len(y)) if compute_s is not None else np.array([], int)
        rows = np.concatenate([parts, np.flatnonzero(single)])
        if not len(rows):
            raise ValueError("no compute to fit: give compute_s, or profile one configuration on a single rank")
        measured = np.asarray(compute_s, float) if compute_s is not None else np.array([])
        A = self._compute_design(batch[rows], per_host[rows] - 1)
        target = np.concatenate([measured, y[single] - self._data(batch[single])])
        coef, self.compute_cov_ = _relative_nnls(
            A, np.maximum(target, 1e-9), weight[rows], self.robust, self.noise_prior
        )
        full = np.zeros(len(COMPUTE_TERMS))
        full[self.compute_columns_] = coef
        for name, value in zip(COMPUTE_TERMS, full):
            setattr(self, name, float(value))
        self.compute_kinks_ = (np.zeros(1), np.ones(1))
        batches = batch[rows]
        if len(set(batches)) >= KINK_MIN_BATCHES:
            line = self._compute(batches, per_host[rows] - 1)
            knots = np.unique(batches)
            ratios = np.array([np.median(np.maximum(target, 1e-9)[batches == b] / line[batches == b]) for b in knots])
            if kinks_predict_better(np.log2(knots), ratios):
                self.compute_kinks_ = (np.log2(knots), ratios)
        for j, ok, value in zip(self.compute_columns_, identified_columns(A), coef):
            name = COMPUTE_TERMS[j].rstrip("_")
            self.identified_[name] = bool(ok)
            if ok and value == 0.0:
                self.notes_.append(
                    f"{name} held at 0 by the non-negativity constraint: the profiles alone would make "
                    f"it negative (e.g. compute growing faster than linearly in b over this range)"
                )

    def _fit_overlap(self, X, y, weight) -> None:
        """g from the multi-rank full steps, the rest of the model fixed (see the module's docstring)."""
        self.overlap_gamma_ = 1.0
        if not len(y):
            return  # no sync profiled: g = 1, Eq. 2's sum, for whatever sync the priors predict
        ranks, batch, per_host = X.T
        data, compute, sync = self._data(batch), self._step_compute(ranks, batch, per_host), self._sync(ranks, per_host)

        def residual(log_gamma: float) -> np.ndarray:
            return (data + overlapped(compute, sync, math.exp(log_gamma))) / y - 1

        low, high = np.log(OVERLAP_GAMMA_BOUNDS)
        huber = np.ones_like(y)
        for _ in range(_robust_rounds(self.robust, len(y), 1)):
            fitted = minimize_scalar(
                lambda g, w=huber * weight: float(np.sum(w * residual(g) ** 2)), bounds=(low, high), method="bounded"
            )
            huber = _huber(residual(fitted.x))
        self.overlap_gamma_ = float(math.exp(fitted.x))
        batches = sorted(set(batch.astype(int)))
        self.identified_["overlap_gamma"] = len(batches) >= 2
        if len(batches) < 2:
            self.notes_.append(
                f"the multi-rank full steps hold one per-device batch (b = {batches[0]}): overlap_gamma fits them, "
                f"but how the overlap grows with the batch is assumed by the form, not identified"
            )
        if min(abs(np.log(self.overlap_gamma_) - bound) for bound in (low, high)) < 1e-3:
            self.notes_.append(
                f"overlap_gamma held at its bound {self.overlap_gamma_:.2f}: the multi-rank full steps would push "
                f"it further (far from the form of compute and sync they were split into)"
            )

    def _hold_sync_at_prior(self) -> None:
        prior = self.sync_prior or SYNC_PRIORS["gpu"]  # a model fitted outside a job: the GPU cluster's
        self.sync_coef_ = np.array(
            [v for kind in SYNC_KINDS for v in (prior[kind]["latency_s"], 1e-9 / prior[kind]["bandwidth_gb_s"])]
        )
        self.identified_.update(dict.fromkeys(SYNC_TERMS, False))

    def _sync_kinds(self, ranks, per_host):
        """Per sync kind: its columns, the rows holding it, and the sizes (ranks per host, or hosts) they hold;
        a kind no row holds is noted as held at its priors and left out."""
        hosts = hosts_spanned(ranks, per_host)
        holds = {"intra_node": (ranks > 1) & (hosts == 1), "inter_node": hosts > 1}
        size = {"intra_node": per_host, "inter_node": hosts}
        if self.sync_fit_ == "latent":  # a latent sync is the whole of it: intra counts wherever a host has peers
            holds["intra_node"] = (ranks > 1) & (per_host > 1)
        for k, kind in enumerate(SYNC_KINDS):
            cols, rows = [2 * k, 2 * k + 1], holds[kind]
            if not rows.any():
                latency, per_byte = self.sync_coef_[cols]
                self.notes_.append(
                    f"{kind.replace('_', '-')} latency and bandwidth held at the priors {latency * 1e6:.1f} us per "
                    f"hop, {1e-9 / per_byte:.1f} GB/s: {SYNC_KIND_TEXT[kind][1]}"
                )
                continue
            yield k, kind, cols, rows, sorted(set(size[kind][rows].astype(int)))

    def _note_latency_held(self, k: int, kind: str, size: int) -> None:
        label = kind.replace("_", "-")
        self.notes_.append(
            f"one {label} sync size profiled ({SYNC_KIND_TEXT[kind][0].format(size)}): latency and bandwidth "
            f"are collinear, {label} latency held at the prior {self.sync_coef_[2 * k] * 1e6:.1f} us per hop"
        )

    def _fit_sync(self, ranks, per_host, sync_s, weight) -> None:
        """Intra terms from syncs on one host, then inter terms from syncs across hosts less their intra part;
        terms the profiles cannot tell are held at the priors (see the module's docstring)."""
        self._hold_sync_at_prior()
        if not (ranks > 1).any():
            return  # no sync profiled: the priors stand
        features = self._sync_features(ranks, per_host)
        for k, kind, cols, rows, sizes in self._sync_kinds(ranks, per_host):
            others = self.sync_coef_.copy()
            others[cols] = 0.0
            measured = np.maximum(sync_s[rows] - features[rows] @ others, 1e-9)
            design = features[rows][:, cols]
            if len(sizes) >= 2:
                self.sync_coef_[cols], _ = _relative_nnls(design, measured, weight[rows], self.robust, self.noise_prior)
                self.identified_.update(dict.fromkeys(SYNC_TERMS[2 * k : 2 * k + 2], True))
                continue
            # One size of this kind: hops and bytes move together, so latency comes from the prior.
            rest = np.maximum(measured - self.sync_coef_[cols[0]] * design[:, 0], 1e-9)
            coef, _ = _relative_nnls(design[:, 1:], rest, weight[rows], self.robust, self.noise_prior)
            self.sync_coef_[cols[1]] = coef[0]
            self.identified_[SYNC_TERMS[2 * k + 1]] = True
            self._note_latency_held(k, kind, sizes[0])

    def _fit_latent_sync(self, X, y, weight) -> None:
        """Sync's terms and g together from the multi-rank full steps, compute and data fixed: the steps say
        how much sync costs only through how much of it stays exposed (see `fit_latent_sync`); interference last,
        where a step is left to spare."""
        self._hold_sync_at_prior()
        self.overlap_gamma_ = 1.0
        self.interference_ = 0.0
        if not len(y):
            return
        ranks, batch, per_host = X.T
        free = []
        for k, kind, cols, _, sizes in self._sync_kinds(ranks, per_host):
            free += cols if len(sizes) >= 2 else cols[1:]
            if len(sizes) < 2:
                self._note_latency_held(k, kind, sizes[0])
        features = self._sync_features(ranks, per_host)
        gamma_free = len(set(batch)) >= 2
        free = identified_subset(features, free, len(y) - gamma_free)
        interference = gamma_free and len(y) - len(free) - gamma_free >= 1
        coef, gamma, self.interference_ = fit_latent_sync(
            self._data(batch),
            self._compute(batch, per_host - 1),
            features,
            y,
            weight,
            self.sync_coef_,
            free,
            LATENT_GAMMA_PRIOR if not gamma_free else None,
            self.robust,
            HUBER_K * max(self.noise_prior, MIN_ROBUST_SCALE),
            interference,
        )
        self.sync_coef_, self.overlap_gamma_ = coef, gamma
        if interference:
            self.notes_.append(
                f"multi-rank compute {self.interference_:.1%} slower than the profiles' compute parts (interference: "
                f"the all-reduce runs beside backward on the same devices), fitted to the full steps"
            )
        self.identified_.update({SYNC_TERMS[j]: True for j in free})
        self.identified_["overlap_gamma"] = gamma_free
        if not gamma_free:
            self.notes_.append(
                f"the multi-rank full steps hold one per-device batch: overlap_gamma held at its prior "
                f"{LATENT_GAMMA_PRIOR:g}, sync fitted at it"
            )

    def _fit_sync_and_levels(self, X, y, weight, sync_s) -> None:
        """Sync's line and g, then the host counts whose multi-rank steps hold an inter-node sync level of their
        own (collective_cost.inter_sync_levels): the most telling is set aside and the line fitted again without
        it, until no other is found or one host count is left to the line."""
        multi = X[:, 0] > 1
        hosts = hosts_spanned(X[:, 0], X[:, 2])
        notes, aside = len(self.notes_), set()
        for _ in range(LEVEL_ROUNDS):
            del self.notes_[notes:]
            self.inter_sync_levels_ = {}
            line = ~np.isin(hosts, sorted(aside))
            if self.sync_fit_ == "split":
                self._fit_sync(X[line, 0], X[line, 2], sync_s[line], weight[line])
                self._fit_overlap(X[line & multi], y[line & multi], weight[line & multi])
            else:
                self._fit_latent_sync(X[line & multi], y[line & multi], weight[line & multi])
            levels = self._inter_sync_levels(X[multi], y[multi], weight[multi])
            new = [count for count in levels if count not in aside]
            if not new or len(set(hosts[line & (hosts > 1)])) < 2:
                break
            aside.add(new[0])
        self.inter_sync_levels_ = levels
        for count, level in levels.items():
            self.notes_.append(
                f"inter-node sync at {count} hosts held at its own level, {level:.2f} x the line over the other host "
                f"counts: its profiles agree on it (a collective may change algorithm with the node count)"
            )

    def _inter_sync_levels(self, X, y, weight) -> dict[int, float]:
        if not len(y):
            return {}
        ranks, batch, per_host = X.T
        intra, inter = self._sync_parts(ranks, per_host)
        data, compute = self._data(batch), self._step_compute(ranks, batch, per_host)
        return inter_sync_levels(
            hosts_spanned(ranks, per_host), data, compute, intra, inter, y, weight, self.overlap_gamma_, KINK_MARGIN
        )

    # -- prediction ---------------------------------------------------------------------------------
    def _rows(self, X) -> np.ndarray:
        """Validated input rows of a fitted model; a single row may come as a flat list."""
        check_is_fitted(self, "profiled_")
        X = check_array(np.asarray(X, float).reshape(-1, 3) if np.ndim(X) == 1 else X, dtype=float)
        if X.shape[1] != self.n_features_in_:
            raise ValueError(f"X has {X.shape[1]} columns; expected 3: ranks, per_device_batch, ranks_per_host")
        return X

    def predict_parts(self, X) -> dict[str, np.ndarray]:
        X = self._rows(X)
        ranks, batch, per_host = X[:, 0], X[:, 1], X[:, 2]
        data, compute, sync = self._data(batch), self._step_compute(ranks, batch, per_host), self._sync(ranks, per_host)
        overlap = overlapped(compute, sync, self.overlap_gamma_)
        return {
            "data_s": data,
            "compute_s": compute,
            "sync_s": sync,
            "exposed_sync_s": overlap - compute,
            "step_s": data + overlap,
        }

    def predict(self, X) -> np.ndarray:
        return self.predict_parts(X)["step_s"]

    def octaves_to_profiled(self, X) -> np.ndarray:
        """Distance in octaves of (b, N) from each row to the nearest profiled configuration."""
        X = np.log2(self._rows(X)[:, :2])
        seen = np.log2(self.profiled_[:, :2])
        return np.sqrt(((X[:, None, :] - seen[None, :, :]) ** 2).sum(-1)).min(axis=1)

    def predict_uncertainty(self, X) -> np.ndarray:
        """Relative standard deviation of the predicted step against a measurement of it: the fitted compute and
        data parameters, the measurement's own noise (noise_prior), and the model's discrepancy per octave."""
        X = self._rows(X)
        batch, per_host = X[:, 1], X[:, 2]
        step = self.predict(X)
        # g is fitted to the full steps with compute and sync fixed: its error (and sync's, which g absorbs on
        # the profiles) is part of the model discrepancy.
        c = self._compute_design(batch, per_host - 1)
        d = np.column_stack([np.ones_like(batch), batch])
        variance = np.einsum("ij,jk,ik->i", c, self.compute_cov_, c) + np.einsum("ij,jk,ik->i", d, self.data_cov_, d)
        discrepancy = self.discrepancy_per_octave * self.octaves_to_profiled(X)
        return np.sqrt(variance / step**2 + self.noise_prior**2 + discrepancy**2)

    def exposed_sync_share(self) -> list[dict]:
        """Exposed sync over sync at the largest profiled N, at its smallest and largest profiled per-device
        batch: g in words (1 is no overlap, 0 full; it falls with b when g > 1). Empty without sync."""
        largest = self.profiled_[self.profiled_[:, 0] == self.profiled_[:, 0].max()]
        if largest[0, 0] == 1:
            return []
        ends = np.unique(largest[[np.argmin(largest[:, 1]), np.argmax(largest[:, 1])]], axis=0)
        parts = self.predict_parts(ends)
        return [
            {"ranks": int(row[0]), "per_device_batch": int(row[1]), "share": float(exposed / sync)}
            for row, exposed, sync in zip(ends, parts["exposed_sync_s"], parts["sync_s"])
        ]

    def coefficients(self) -> dict:
        """The fitted terms by name, as perfmodel.json records them (not get_params: those are the settings)."""
        return {
            "data_intercept_s": float(self.data_coef_[0]),
            "data_per_sample_s": float(self.data_coef_[1]),
            "batch_ref": self.batch_ref_,
            **{name.rstrip("_"): getattr(self, name) for name in COMPUTE_TERMS},
            "overlap_gamma": self.overlap_gamma_,
            "interference": self.interference_,
            "exposed_sync_share": self.exposed_sync_share(),
            **{name: float(value) for name, value in zip(SYNC_TERMS, self.sync_coef_)},
            "rms_rel_error": self.rms_rel_error_,
            "discrepancy_per_octave": self.discrepancy_per_octave,
            "sync_fit": self.sync_fit_,
            "inter_sync_levels": [
                {"hosts": count, "over_line": level} for count, level in sorted(self.inter_sync_levels_.items())
            ],
            "compute_kinks": [
                {"per_device_batch": float(2**knot), "over_line": float(ratio)}
                for knot, ratio in zip(*self.compute_kinks_)
                if len(self.compute_kinks_[0]) > 1
            ],
        }

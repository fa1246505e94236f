"""What a gradient sync costs and how much of it a step shows: the collective's terms laid out over hosts, its
overlap with compute, and its fit where only the overlapped step is measured (the performance model's sync).

Sync is hierarchical, as Horovod's hierarchical all-reduce runs it and as AdaptDL's goodput model keeps
intra- and inter-node network terms apart (a hop over NVLink or shared memory and one over the network
differ by an order of magnitude): a ring reduce-scatters among each host's h ranks, all-reduces the
shards across the H hosts, and all-gathers them back, so the host part costs a ring all-reduce among h
and the network part one among H; the h shards cross the network side by side, so inter beta is per
byte of a host's whole network (all its NICs). A parameter server likewise reduces each host's ranks to
one, then serves the hosts. On one host (the local launcher) inter is 0 and sync is the flat collective
among the N ranks.

Latent sync (`sync_fit_` "latent"): where profiles hold the full, overlapped step without a sync part (published
GPU traces; a GPU cluster, where stopping at a barrier to time the all-reduce alone perturbs the overlap it is
meant to inform), sync's terms and g are fitted together to the multi-rank full steps, compute and data fixed
(`fit_latent_sync`), as Pollux fits its own model: a step shows sync only through the part of it compute leaves
exposed. Each kind's terms are fitted where rows hold that kind at enough sizes and the rank of their columns
allows, latency given up to its prior first; g is held at LATENT_GAMMA_PRIOR when the steps hold one batch.
The loss is Cauchy's (with rows to spare): published step times hold single outliers (a 2-node sync slower
than a 4-node one) that a Huber loss still lets pull every term.

Interference (`interference`, i): the all-reduce's kernels run beside backward on the same device and share its
compute units and memory bandwidth, so a multi-rank step's compute takes compute x (1 + i), longer than the profile's
compute part, timed with no collective beside it. On the Pollux traces' T4s, step less exposed sync exceeds the
one-GPU step by 5-20 % at large batches, where backward hides the whole sync, and by nothing at small ones, where the
slowed compute hides behind sync: no g can follow that, and a g fitted to the large batches over-predicts the middle
ones by 20-30 %. i is fitted last, only where the multi-rank steps hold two batches and one row is left to spare
after sync's terms and g.

A host count of its own (`inter_sync_levels`): latency and bandwidth make inter-node sync smooth in the host count, a
collective library need not be (NCCL picks its algorithm and channels by node count). On the Pollux traces' T4
cluster 2 nodes synced about twice as slowly as the line through 3 to 16 nodes says, at every batch and every
GPUs-per-node, so a line fitted past it predicted every 2-node step 20-60 % short. A host count profiled
LEVEL_MIN_PROFILES times or more keeps its own level where that level, fitted to its other profiles, predicts each of
its steps better than the line (by the compute kinks' margin); noise alone predicts held-out steps worse. One host
count off the line pulls the line toward it, and every other then looks off too: so they are set aside one at a
time, the most telling first, the line fitted again without each, and at least one host count is left to the line.
Host counts never profiled keep the line: nothing says where a library's switch lies between two that were.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.optimize import least_squares, minimize_scalar, nnls

# The range g is fitted in. Below 1 a step exceeds compute + sync, which only contention for the cores explains;
# at the floor two equal parts already cost 2^(1/0.3) = 10 times one. At 30 the combination is max() within 2.3 %.
OVERLAP_GAMMA_BOUNDS = (0.3, 30.0)
# Profiles a host count needs for a sync level of its own, as compute needs three batches for kinks: each is held out
# against at least two (one held out against one is little evidence against 3 % noise).
LEVEL_MIN_PROFILES = 3
# The range of interference i: none, up to compute twice as slow beside the collective.
INTERFERENCE_BOUNDS = (0.0, 1.0)


def sync_features(ranks, grad_bytes: float, collective: str) -> np.ndarray:
    """Columns (hops, bytes moved per peer) of the collective among `ranks` peers; both zero on one."""
    ranks = np.asarray(ranks, float)
    multi = (ranks > 1).astype(float)
    if collective == "ring":
        return np.column_stack([2 * (ranks - 1), 2 * (ranks - 1) / ranks * grad_bytes])
    if collective == "parameter_server":
        return np.column_stack([2 * multi, 2 * ranks * grad_bytes * multi])
    raise ValueError(f"unknown collective '{collective}'; allowed: ring, parameter_server")


def hosts_spanned(ranks, ranks_per_host) -> np.ndarray:
    """Hosts a sync of `ranks` ranks crosses, `ranks_per_host` on each."""
    return np.maximum(1.0, np.round(np.asarray(ranks, float) / np.asarray(ranks_per_host, float)))


def hierarchical_sync_features(ranks, ranks_per_host, grad_bytes: float, collective: str) -> np.ndarray:
    """Columns (intra hops, intra bytes, inter hops, inter bytes): the collective among each host's ranks,
    then among the hosts spanned (see the module's docstring)."""
    per_host = np.asarray(ranks_per_host, float)
    return np.hstack(
        [
            sync_features(per_host, grad_bytes, collective),
            sync_features(hosts_spanned(ranks, per_host), grad_bytes, collective),
        ]
    )


def overlapped(compute, sync, gamma: float) -> np.ndarray:
    """(compute^g + sync^g)^(1/g), scaled by the larger part so that neither underflows at large g."""
    compute, sync = np.asarray(compute, float), np.asarray(sync, float)
    larger = np.maximum(np.maximum(compute, sync), 1e-300)
    return larger * ((compute / larger) ** gamma + (sync / larger) ** gamma) ** (1 / gamma)


def identified_columns(A: np.ndarray) -> list[bool]:
    """Column j is identified when dropping it lowers the rank (no other column can stand in for it)."""
    if A.size == 0:
        return []
    norm = A / np.maximum(np.abs(A).max(axis=0), 1e-300)
    rank = np.linalg.matrix_rank(norm)
    return [np.linalg.matrix_rank(np.delete(norm, j, axis=1)) < rank for j in range(A.shape[1])]


def identified_subset(features: np.ndarray, wanted: list[int], room: int) -> list[int]:
    """The wanted sync columns the rows identify, latencies given up first (they are held at their priors), at
    most `room` of them."""
    chosen = list(wanted)
    for j in sorted(wanted, key=lambda j: (j % 2, j)):  # latency columns (even) before bandwidth columns
        ok = identified_columns(features[:, chosen]) if chosen else []
        if len(chosen) <= room and all(ok):
            break
        chosen.remove(j)
    return chosen


def fit_latent_sync(
    data, compute, features, y, weight, prior, free, gamma=None, robust=True, f_scale=0.05, interference=False
):
    """Sync coefficients (columns `free` of `prior` fitted, the rest held), g (fitted unless given) and, with
    `interference`, i (else 0) that make data + overlapped(compute x (1 + i), features @ coef, g) meet the steps y in
    relative error: (coef, g, i).

    Each fitted coefficient is its prior times exp(u): positive, and on one scale whatever its units. Started from
    the sync each step implies at g = 1 and at g = 4 (a start at the prior alone would sit where sync hides
    wholly behind compute and the steps say nothing about it), and from no interference; the better of the two ends
    wins.
    """
    free = list(free)
    low, high = np.log(OVERLAP_GAMMA_BOUNDS)
    fitted_g, fitted_i = gamma is None, bool(interference)
    spare = len(y) - len(free) - fitted_g - fitted_i
    loss = "cauchy" if robust and spare > 1 else "linear"
    scale = np.sqrt(weight)

    def unpack(u):
        coef = prior.copy()
        coef[free] = prior[free] * np.exp(u[: len(free)])
        g = math.exp(u[len(free)]) if fitted_g else gamma
        return coef, g, (float(u[-1]) if fitted_i else 0.0)

    def residual(u):
        coef, g, slowdown = unpack(u)
        return scale * ((data + overlapped(compute * (1 + slowdown), features @ coef, g)) / y - 1)

    if not free and not fitted_g and not fitted_i:
        return prior.copy(), gamma, 0.0
    best = None
    for g0 in (1.0, 4.0) if fitted_g else (gamma,):
        overlap = np.maximum(y - data, 1e-12)
        exposed = overlap > compute * (1 + 1e-3)
        u0 = np.zeros(len(free) + fitted_g + fitted_i)
        if exposed.any() and free:
            implied = (overlap[exposed] ** g0 - compute[exposed] ** g0) ** (1 / g0)
            held = features[exposed] @ np.where(np.isin(np.arange(len(prior)), free), 0.0, prior)
            coef, _ = nnls(features[exposed][:, free] / implied[:, None], np.maximum(implied - held, 1e-12) / implied)
            u0[: len(free)] = np.log(np.maximum(coef, prior[free] * 1e-6) / prior[free])
        if fitted_g:
            u0[len(free)] = math.log(g0)
        bounds = (
            np.r_[np.full(len(free), -30.0), [low] * fitted_g, [INTERFERENCE_BOUNDS[0]] * fitted_i],
            np.r_[np.full(len(free), 30.0), [high] * fitted_g, [INTERFERENCE_BOUNDS[1]] * fitted_i],
        )
        found = least_squares(residual, u0, bounds=bounds, loss=loss, f_scale=f_scale)
        if best is None or found.cost < best.cost:
            best = found
    return unpack(best.x)


def inter_sync_levels(hosts, data, compute, intra, inter, y, weight, gamma: float, margin: float) -> dict[int, float]:
    """{host count: its inter-node sync over the line's} for the host counts whose steps hold a level of their own
    (see the module's docstring), the one whose level predicts best against the line first; rows are multi-rank
    steps y with their data, compute and the line's intra and inter sync."""

    def error(rows, level: float) -> np.ndarray:
        return (data[rows] + overlapped(compute[rows], intra[rows] + level * inter[rows], gamma)) / y[rows] - 1

    def level_of(rows) -> float:
        found = minimize_scalar(
            lambda u: float(np.sum(weight[rows] * error(rows, math.exp(u)) ** 2)), bounds=(-3.0, 3.0), method="bounded"
        )
        return math.exp(found.x)

    kept = []
    for count in np.unique(hosts[hosts > 1]):
        rows = np.flatnonzero(hosts == count)
        if len(rows) < LEVEL_MIN_PROFILES:
            continue
        held_out = np.mean([abs(error([i], level_of(rows[rows != i]))[0]) for i in rows])
        line = np.mean(np.abs(error(rows, 1.0)))
        if held_out < margin * line:
            kept.append((held_out / line, int(count), level_of(rows)))
    return {count: level for _, count, level in sorted(kept)}

"""Search modes: which candidates each profiles, partial search's extremes identifying the model, and adaptive
search on synthetic timings."""

import numpy as np
import pytest

from tests.unit.test_performance import PRIOR, TRUE, profile_record
from tests.unit.test_plan import SEARCH, search_over
from tula_hpc.core.run_layout import ranks_per_host
from tula_hpc.performance.collective_cost import sync_features
from tula_hpc.performance.estimator import PerfModel
from tula_hpc.performance.fitting import candidate_row
from tula_hpc.performance.search_modes import (
    MODES,
    SECOND_BATCHES,
    VALIDATIONS,
    adaptive_search,
    adds_profiles,
    partial_set,
    planned,
)
from tula_hpc.stages.plan import candidate_grid


def test_each_mode_plans_its_profiles_and_only_adaptive_adds_more():
    grid = candidate_grid(SEARCH, max_batch_per_device=64, train_samples=10_000)
    assert planned("full", grid, 1, "local") == planned("full", grid, 1, "local", "middle") == grid
    for second_batch in SECOND_BATCHES:
        partial = partial_set(grid, 1, "local", second_batch)
        assert planned("partial", grid, 1, "local", second_batch) == partial
        assert planned("adaptive", grid, 1, "local", second_batch) == partial
    assert [adds_profiles(mode) for mode in MODES] == [False, False, True]
    assert [adds_profiles(mode, confirm=2) for mode in MODES] == [True, False, True]  # full measured everything
    for unknown in (lambda: planned("grid", grid, 1, "local"), lambda: adds_profiles("grid")):
        with pytest.raises(ValueError, match="unknown search mode 'grid'; allowed: partial, full, adaptive"):
            unknown()
    with pytest.raises(ValueError, match="unknown second batch 'median'; allowed: largest, middle"):
        partial_set(grid, 1, "local", "median")


def test_partial_plans_the_extremes_the_largest_configuration_and_a_second_multi_rank_size():
    grid = candidate_grid(SEARCH, max_batch_per_device=64, train_samples=10_000)
    # Smallest and largest batch at N=1; at N=4 the smallest and the largest, which the time objective usually
    # picks; N=2's smallest batch separates latency from bandwidth. On a cluster (every node holds the same
    # ranks) the same: the second batch at N=4 tells how the overlap grows with the batch there too.
    for launcher in ("local", "slurm"):
        assert [(c["nodes"], c["batch"]) for c in partial_set(grid, 1, launcher)] == [
            (1, 32),
            (1, 64),
            (4, 32),
            (4, 256),
            (2, 32),
        ]
    # middle: at N=4 the batch at the geometric middle of its range instead (per device 8..64: 16 and 32 tie,
    # the cheaper wins).
    assert [(c["nodes"], c["batch"]) for c in partial_set(grid, 1, "slurm", "middle")] == [
        (1, 32),
        (1, 64),
        (4, 32),
        (4, 64),
        (2, 32),
    ]


def test_partial_on_one_node_count_has_no_duplicates():
    grid = candidate_grid(search_over(nodes=(1, 1), batch=(32, 32)), 64, 1000)
    assert partial_set(grid, 1, "local") == grid


def _identified(configs, devices, launcher):
    """Which coefficients profiles at `configs` identify (timings need not be real for that: only where they are)."""
    ranks = np.array([c["nodes"] * devices for c in configs], float)
    batch = np.array([c["per_device_batch"] for c in configs], float)
    hosts = np.array([ranks_per_host(launcher, c["nodes"], devices) for c in configs], float)
    sync = sync_features(ranks, 4e7, "ring") @ np.array([1e-4, 2e-10])
    compute = 1e-3 + 1e-4 * batch + (hosts - 1) * (5e-4 + 1e-5 * batch)
    data = 1e-5 * batch + 1e-4
    model = PerfModel(grad_bytes=4e7).fit(
        np.column_stack([ranks, batch, hosts]),
        data + np.hypot(compute, sync),  # the overlap's g = 2
        data_s=data,
        compute_s=compute,
        sync_s=sync,
    )
    return model.identified_


CASES = [((1, 2), 1, "local"), ((1, 8), 1, "local"), ((2, 8), 1, "local"), ((1, 4), 4, "slurm"), ((1, 16), 1, "slurm")]


def _partial(nodes, devices, launcher, second_batch="largest"):
    search = search_over(nodes, batch=(8 * devices, "auto"), gpus=(devices, devices))
    grid = candidate_grid(search, max_batch_per_device=512, train_samples=1_000_000)
    return grid, partial_set(grid, devices, launcher, second_batch)


@pytest.mark.parametrize("second_batch", SECOND_BATCHES)
@pytest.mark.parametrize("nodes, devices, launcher", CASES)
def test_partial_identifies_every_coefficient_the_full_grid_does(nodes, devices, launcher, second_batch):
    grid, chosen = _partial(nodes, devices, launcher, second_batch)
    assert _identified(chosen, devices, launcher) == _identified(grid, devices, launcher)


@pytest.mark.parametrize("nodes, devices, launcher", CASES)
def test_beyond_the_corners_no_partial_profile_is_spare(nodes, devices, launcher):
    # The batch extremes at the smallest and the largest N give the fit its leverage (the compute line, and
    # the overlap where sync is longest against compute and where it is shortest); every other profile must be
    # needed to identify something.
    grid, chosen = _partial(nodes, devices, launcher)
    corners = [c for c in chosen if c["nodes"] in (nodes[0], nodes[1])]
    assert len(corners) == 4
    everything = _identified(grid, devices, launcher)
    for member in chosen:
        if member not in corners:
            rest = [c for c in chosen if c is not member]
            assert _identified(rest, devices, launcher) != everything, f"{member} is spare"


def _adaptive(curvature, tolerance=0.05):
    grid = [
        c
        for c in candidate_grid(search_over(nodes=(1, 2), batch=(8, 1024)), 512, 100_000)
        if c["per_device_batch"] >= 8
    ]
    settings = {
        "collective": "ring",
        "sync_prior": {**PRIOR, "intra_node": {"latency_s": TRUE["sync"][0], "bandwidth_gb_s": 50.0}},
        "noise_prior": 0.01,
        "discrepancy_per_octave": 0.02,
    }
    measure = lambda c: profile_record(c["nodes"], c["per_device_batch"], curvature=curvature)  # noqa: E731
    return grid, adaptive_search(
        grid, partial_set(grid, 1, "local"), measure, lambda c: candidate_row(c, 1, "local"), settings, tolerance
    )


def test_adaptive_search_stops_early_when_new_profiles_confirm_the_model():
    grid, result = _adaptive(curvature=0.0)
    assert len(result["profiled"]) < len(grid)
    assert all(h["rel_error"] < 0.01 for h in result["history"])
    # however sure the model is of the rest, it stops only after VALIDATIONS profiles it added were predicted
    assert len(result["history"]) == VALIDATIONS


def test_adaptive_search_keeps_profiling_where_the_model_is_wrong():
    grid, straight = _adaptive(curvature=0.0)
    _, curved = _adaptive(curvature=3e-7)  # compute bends upward: a straight line misses the middle by 30 %
    assert len(curved["profiled"]) > len(straight["profiled"])
    assert curved["discrepancy_per_octave"] > straight["discrepancy_per_octave"]
    assert max(h["rel_error"] for h in curved["history"]) > 0.25  # it found where the straight line misses most


# --- node shapes: several GPUs per node (issue 25) -----------------------------------------------------------------

SHAPES = search_over(nodes=(1, 4), batch=(32, "auto"), gpus=(1, 4))


def _shapes_identified(configs) -> dict:
    """Which coefficients profiles at `configs` (a cluster's, each on its own GPUs per node) identify."""
    from tests.unit.test_performance import fit, synthetic

    ranks, batch, per_host = zip(*(candidate_row(c, c["gpus_per_node"], "slurm") for c in configs))
    return fit(synthetic(ranks, batch, per_host)).identified_


def test_partial_over_node_shapes_profiles_each_term_where_it_is_alone():
    grid = candidate_grid(SHAPES, max_batch_per_device=64, train_samples=10_000)
    chosen = partial_set(grid, 4, "slurm")
    # Compute on one rank at both batch extremes; intra-node sync on one node of 4 GPUs and of 2; inter-node sync at
    # 4 and at 2 hosts of 4 GPUs; how the overlap grows with the batch at the largest configuration.
    assert [(c["nodes"], c["gpus_per_node"], c["batch"]) for c in chosen] == [
        (1, 1, 32),
        (1, 1, 64),
        (1, 4, 32),
        (1, 2, 32),
        (4, 4, 32),
        (2, 4, 32),
        (4, 4, 1024),
    ]
    assert partial_set(grid, 4, "slurm", "middle")[-1] == {
        "nodes": 4,
        "gpus_per_node": 4,
        "batch": 128,
        "per_device_batch": 8,
    }
    # Everything the whole grid identifies: two sizes of each kind of sync
    assert _shapes_identified(chosen) == _shapes_identified(grid)


def test_the_second_sync_size_is_the_middle_one_not_the_smallest():
    """Eight hosts' worth of node counts: the second inter-node size at the geometric middle of 2..16 (N = 4 or 8
    nearest sqrt(32) = 5.7, ties to the smaller), not at 2."""
    grid = candidate_grid(search_over(nodes=(1, 16), batch=(32, "auto")), 64, 100_000)
    second = [c["nodes"] for c in partial_set(grid, 1, "slurm") if c["nodes"] not in (1, 16)]
    assert second == [4]


def _without_shape(candidates: list[dict]) -> list[dict]:
    """The candidates as a plan made before GPUs per node was a choice holds them."""
    return [{key: value for key, value in c.items() if key != "gpus_per_node"} for c in candidates]


def test_one_node_shape_is_searched_as_before():
    shaped = candidate_grid(search_over(nodes=(1, 4), batch=(32, "auto"), gpus=(2, 2)), 64, 10_000)
    assert {c["gpus_per_node"] for c in shaped} == {2}
    for launcher in ("local", "slurm"):
        assert _without_shape(partial_set(shaped, 2, launcher)) == partial_set(_without_shape(shaped), 2, launcher)

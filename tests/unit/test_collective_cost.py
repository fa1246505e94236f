"""A sync's cost laid out over hosts, its overlap with compute, and its latent fit, on known answers."""

import numpy as np
import pytest

from tula_hpc.performance.collective_cost import (
    fit_latent_sync,
    hierarchical_sync_features,
    hosts_spanned,
    identified_subset,
    inter_sync_levels,
    overlapped,
    sync_features,
)

GRAD_BYTES = 1e8


def test_a_ring_counts_its_hops_and_bytes_and_one_peer_syncs_nothing():
    np.testing.assert_allclose(sync_features([1, 2, 4], GRAD_BYTES, "ring"), [[0, 0], [2, 1e8], [6, 1.5e8]])
    np.testing.assert_allclose(sync_features([1, 4], GRAD_BYTES, "parameter_server"), [[0, 0], [2, 8e8]])
    assert hosts_spanned([4, 8, 16], [4, 4, 4]).tolist() == [1, 2, 4]
    # 8 ranks, 4 per host: a ring among each host's 4, then among the 2 hosts
    np.testing.assert_allclose(hierarchical_sync_features([8], [4], GRAD_BYTES, "ring"), [[6, 1.5e8, 2, 1e8]])
    with pytest.raises(ValueError, match="unknown collective 'tree'; allowed: ring, parameter_server"):
        sync_features([2], GRAD_BYTES, "tree")


def test_overlap_adds_at_one_and_hides_the_shorter_part_as_g_grows():
    assert overlapped(3.0, 4.0, 1.0) == pytest.approx(7.0)
    assert overlapped(3.0, 4.0, 2.0) == pytest.approx(5.0)
    assert overlapped(3.0, 4.0, 30.0) == pytest.approx(4.0, rel=0.01)
    assert overlapped(1e-200, 1e-200, 30.0) > 0  # scaled by the larger part: no underflow


def test_latent_sync_and_g_come_back_from_full_steps_with_outliers_left_aside():
    """Steps of known sync (latency and bandwidth among 2 to 16 hosts) and g, one of them an outlier far above the
    rest: the fit gives the terms back, the outlier moving them little (Cauchy's loss)."""
    rng = np.random.default_rng(0)
    hosts = np.repeat([2, 3, 4, 6, 8, 12, 16], 4).astype(float)
    compute = np.tile([0.02, 0.05, 0.1, 0.2], 7)
    features = sync_features(hosts, GRAD_BYTES, "ring")
    truth, gamma = np.array([2e-3, 5e-10]), 3.0
    steps = overlapped(compute, features @ truth, gamma) * (1 + 0.005 * rng.standard_normal(len(hosts)))
    steps[5] *= 1.5
    prior = np.array([1e-5, 1e-10])  # a prior far off: the fit starts from the sync the steps imply
    coef, fitted_gamma, interference = fit_latent_sync(
        np.zeros_like(steps), compute, features, steps, np.ones_like(steps), prior, [0, 1], f_scale=0.02
    )
    assert coef == pytest.approx(truth, rel=0.05)
    assert fitted_gamma == pytest.approx(gamma, rel=0.1)
    assert interference == 0.0  # not asked for


def test_interference_comes_back_where_backward_hides_sync_and_not_where_sync_hides_compute():
    """Steps whose compute runs 15 % slower beside the all-reduce, with sync mostly hidden at large batches: the
    fit gives i back with sync and g; without i, g alone bends to the large batches and misses the middle ones."""
    hosts = np.repeat([2, 4, 8, 16], 5).astype(float)
    compute = np.tile([0.01, 0.03, 0.1, 0.3, 1.0], 4)
    features = sync_features(hosts, GRAD_BYTES, "ring")
    truth, gamma, slowdown = np.array([2e-3, 5e-10]), 3.0, 0.15
    steps = overlapped(compute * (1 + slowdown), features @ truth, gamma)
    prior, zeros, ones = np.array([1e-5, 1e-10]), np.zeros_like(steps), np.ones_like(steps)
    coef, fitted_gamma, interference = fit_latent_sync(
        zeros, compute, features, steps, ones, prior, [0, 1], robust=False, interference=True
    )
    assert interference == pytest.approx(slowdown, rel=0.02)
    assert coef == pytest.approx(truth, rel=0.05) and fitted_gamma == pytest.approx(gamma, rel=0.05)
    coef, fitted_gamma, _ = fit_latent_sync(zeros, compute, features, steps, ones, prior, [0, 1], robust=False)
    without = overlapped(compute, features @ coef, fitted_gamma) / steps - 1
    assert np.abs(without).max() > 0.05


def test_latent_sync_holds_what_it_is_not_asked_to_fit():
    hosts = np.array([2.0, 2.0])
    compute = np.array([0.01, 0.04])
    features = sync_features(hosts, GRAD_BYTES, "ring")
    prior = np.array([1e-5, 1e-10])
    steps = overlapped(compute, features @ np.array([1e-5, 3e-10]), 2.0)
    coef, gamma, interference = fit_latent_sync(np.zeros(2), compute, features, steps, np.ones(2), prior, [1], 2.0)
    assert coef[0] == prior[0] and coef[1] == pytest.approx(3e-10, rel=1e-3) and gamma == 2.0 and interference == 0


def test_columns_the_rows_cannot_tell_apart_give_up_latency_first():
    one_size = sync_features(np.array([4.0, 4.0]), GRAD_BYTES, "ring")  # hops and bytes move together
    assert identified_subset(one_size, [0, 1], room=2) == [1]
    two_sizes = sync_features(np.array([2.0, 8.0]), GRAD_BYTES, "ring")
    assert identified_subset(two_sizes, [0, 1], room=2) == [0, 1]
    assert identified_subset(two_sizes, [0, 1], room=1) == [1]


def test_a_host_count_keeps_its_own_sync_level_where_all_its_steps_agree_and_noise_keeps_the_line():
    """Steps at 2 to 8 hosts, 4 batches each, whose 2-host sync runs at twice the line's (every batch says so):
    2 hosts get their level back, the others keep the line; the same steps with 3 % noise and no such host count
    keep the line everywhere (a level fitted to the noise predicts its held-out steps worse)."""
    hosts = np.repeat([2, 3, 4, 8], 4).astype(float)
    compute = np.tile([0.02, 0.05, 0.1, 0.2], 4)
    inter = sync_features(hosts, GRAD_BYTES, "ring") @ np.array([2e-3, 5e-10])
    zeros, ones, gamma = np.zeros_like(hosts), np.ones_like(hosts), 3.0
    level = np.where(hosts == 2, 2.0, 1.0)
    steps = overlapped(compute, level * inter, gamma)
    found = inter_sync_levels(hosts, zeros, compute, zeros, inter, steps, ones, gamma, margin=0.7)
    assert list(found) == [2] and found[2] == pytest.approx(2.0, rel=1e-3)
    noisy = overlapped(compute, inter, gamma) * (1 + 0.03 * np.tile([1, -1, -1, 1], 4))
    assert inter_sync_levels(hosts, zeros, compute, zeros, inter, noisy, ones, gamma, margin=0.7) == {}
    twice = np.array([0, 1, 4, 5, 6, 7])  # 2 hosts profiled twice: one held out against one is no evidence
    assert inter_sync_levels(*(a[twice] for a in (hosts, zeros, compute, zeros, inter, steps, ones)), gamma, 0.7) == {}

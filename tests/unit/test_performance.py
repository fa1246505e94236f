"""The performance model on synthetic timings of known coefficients, and adaptive search over them."""

from dataclasses import replace

import numpy as np
import pytest

from tests.conftest import default_job
from tula_hpc.core.job import Span
from tula_hpc.performance.estimator import OVERLAP_GAMMA_BOUNDS, SYNC_TERMS, PerfModel, hierarchical_sync_features
from tula_hpc.performance.fitting import candidate_row, measurement_weight
from tula_hpc.performance.search_modes import partial_set
from tula_hpc.stages.plan import candidate_grid

GRAD_BYTES = 4e7


TRUE = {
    "data": (1e-4, 2e-6),
    "compute": (2e-3, 3e-4),
    "contention": (1e-3, 5e-5),
    "sync": np.array([1e-4, 2e-10, 3e-4, 1e-9]),  # intra-node latency, s/byte; inter-node latency, s/byte
    "gamma": 3.0,  # the overlap: sync mostly hidden behind compute once compute outgrows it
}
PRIOR = {
    "intra_node": {"latency_s": 3e-5, "bandwidth_gb_s": 50.0},
    "inter_node": {"latency_s": 5e-5, "bandwidth_gb_s": 10.0},
}


def synthetic(ranks, batch, per_host=None, noise=0.0, seed=0, curvature=0.0, gamma=TRUE["gamma"]):
    """Parts and full step of the model's own form (plus optional curvature in b), with relative noise;
    every rank on one host unless `per_host` says how many share one."""
    rng = np.random.default_rng(seed)
    ranks, batch = np.asarray(ranks, float), np.asarray(batch, float)
    per_host = ranks if per_host is None else np.asarray(per_host, float)
    data = TRUE["data"][0] + TRUE["data"][1] * batch
    compute = (
        TRUE["compute"][0]
        + TRUE["compute"][1] * batch
        + curvature * batch**2
        + (per_host - 1) * (TRUE["contention"][0] + TRUE["contention"][1] * batch)
    )
    sync = hierarchical_sync_features(ranks, per_host, GRAD_BYTES, "ring") @ TRUE["sync"]
    jitter = lambda x: x * (1 + noise * rng.standard_normal(x.shape))  # noqa: E731
    return {
        "X": np.column_stack([ranks, batch, per_host]),
        "y": jitter(data + (compute**gamma + sync**gamma) ** (1 / gamma)),
        "data_s": jitter(data),
        "compute_s": jitter(compute),
        "sync_s": jitter(sync),
    }


def fit(d, **params):
    return PerfModel(grad_bytes=GRAD_BYTES, **params).fit(
        d["X"], d["y"], data_s=d["data_s"], compute_s=d["compute_s"], sync_s=d["sync_s"]
    )


def grid_points(nodes=(1, 2, 4, 8), batches=(8, 16, 32, 64, 128, 256, 512)):
    ranks, batch = np.meshgrid(nodes, batches)
    return ranks.ravel(), batch.ravel()


def profile_record(ranks, batch, seed=0, **kw):
    """A profile file's content for one configuration, from the synthetic truth."""
    d = synthetic([ranks], [batch], seed=seed, **kw)
    return {
        "world_size": ranks,
        "per_device_batch": batch,
        "ranks_per_host": ranks,
        "grad_bytes": GRAD_BYTES,
        "median": {
            "step_s": d["y"][0],
            "data_s": d["data_s"][0],
            "compute_s": d["compute_s"][0],
            "update_s": 0.0,
            "sync_s": d["sync_s"][0],
        },
    }


def test_fit_recovers_known_coefficients_from_noisy_timings():
    model = fit(synthetic(*grid_points(), noise=0.02))
    assert model.batch_ref_ == 8  # compute is anchored at the smallest profiled batch
    assert model.intercept_s_ == pytest.approx(TRUE["compute"][0] + 8 * TRUE["compute"][1], rel=0.1)
    assert model.per_sample_s_ == pytest.approx(TRUE["compute"][1], rel=0.03)
    assert model.contention_s_ == pytest.approx(TRUE["contention"][0] + 8 * TRUE["contention"][1], rel=0.3)
    assert model.contention_per_sample_s_ == pytest.approx(TRUE["contention"][1], rel=0.1)
    assert model.overlap_gamma_ == pytest.approx(TRUE["gamma"], rel=0.1)
    assert model.sync_coef_[1] == pytest.approx(TRUE["sync"][1], rel=0.1)
    inter = {"inter_node_latency_s", "inter_node_seconds_per_byte"}  # every profile on one host
    assert {name for name, ok in model.identified_.items() if not ok} == inter
    truth = synthetic([16], [1024])["y"][0]
    assert model.predict([[16, 1024, 16]])[0] == pytest.approx(truth, rel=0.05)


def test_partial_profiles_predict_every_unprofiled_candidate_without_noise():
    search = replace(default_job().search, nodes=Span(1, 8), batch=Span(8, "auto"), gpus_per_node=Span(1, 1))
    grid = candidate_grid(search, 512, 100_000)
    chosen = partial_set(grid, devices_per_node=1, launcher="local")
    d = synthetic([c["nodes"] for c in chosen], [c["per_device_batch"] for c in chosen])
    model = fit(d)
    everything = synthetic([c["nodes"] for c in grid], [c["per_device_batch"] for c in grid])
    np.testing.assert_allclose(model.predict(everything["X"]), everything["y"], rtol=1e-6)


# One rank's batch extremes, and two per-device batches at each of N = 2 and 4: the overlap is identified.
OVERLAP_PROFILES = ([1, 1, 2, 2, 4, 4], [8, 512, 8, 64, 8, 64])


@pytest.mark.parametrize("gamma", [3.0, 0.7])
def test_the_overlap_is_recovered_and_predicts_a_large_unprofiled_step(gamma):
    model = fit(synthetic(*OVERLAP_PROFILES, noise=0.002, seed=1, gamma=gamma))
    assert model.identified_["overlap_gamma"]
    assert model.overlap_gamma_ == pytest.approx(gamma, rel=0.03)
    truth = synthetic([8], [256], gamma=gamma)["y"][0]  # beyond every multi-rank profile; g = 1 misses it by 9-14 %
    assert model.predict([[8, 256, 8]])[0] == pytest.approx(truth, rel=0.01)


def test_without_overlap_the_exposed_sync_is_all_of_sync():
    model = fit(synthetic(*OVERLAP_PROFILES, gamma=1.0))
    assert model.overlap_gamma_ == pytest.approx(1.0, rel=1e-3)
    parts = model.predict_parts([[2, 8, 2], [8, 1024, 8]])
    np.testing.assert_allclose(parts["exposed_sync_s"], parts["sync_s"], rtol=1e-3)


def test_the_exposed_share_of_sync_falls_with_the_batch_when_sync_overlaps_and_rises_when_it_slows_compute():
    batches = [[4, b, 4] for b in (8, 64, 512, 4096)]
    model = fit(synthetic(*OVERLAP_PROFILES))
    overlap = model.predict_parts(batches)
    share = overlap["exposed_sync_s"] / overlap["sync_s"]
    assert share[0] < 1 and np.all(np.diff(share) < 0)
    # coefficients() names it at the largest profiled N's smallest and largest batch
    shares = model.coefficients()["exposed_sync_share"]
    assert [(s["ranks"], s["per_device_batch"]) for s in shares] == [(4, 8), (4, 64)]
    assert [s["share"] for s in shares] == pytest.approx(list(share[:2]))
    contended = fit(synthetic(*OVERLAP_PROFILES, gamma=0.7)).predict_parts(batches)
    share = contended["exposed_sync_s"] / contended["sync_s"]
    assert share[0] > 1 and np.all(np.diff(share) > 0)


def test_one_multi_rank_batch_fits_the_overlap_but_says_its_growth_with_the_batch_is_assumed():
    d = synthetic([1, 1, 2], [8, 512, 8])
    model = fit(d)
    np.testing.assert_allclose(model.predict(d["X"]), d["y"], rtol=1e-6)
    assert model.identified_["overlap_gamma"] is False
    assert any("one per-device batch (b = 8)" in note and "not identified" in note for note in model.notes_)
    assert fit(synthetic(*OVERLAP_PROFILES)).identified_["overlap_gamma"] is True


def test_steps_hiding_even_a_sync_longer_than_compute_hold_the_overlap_at_its_bound_and_say_so():
    d = synthetic(*OVERLAP_PROFILES)
    d["y"] = d["data_s"] + d["compute_s"]  # no sync at all in the full step, where max(compute, sync) is its least
    model = fit(d)
    assert model.overlap_gamma_ == pytest.approx(OVERLAP_GAMMA_BOUNDS[1], rel=1e-2)
    assert any("bound" in note for note in model.notes_)


def test_one_multi_rank_size_fixes_latency_at_the_prior_and_says_so():
    ranks, batch = grid_points(nodes=(1, 2))
    model = fit(synthetic(ranks, batch), sync_prior=PRIOR)
    assert model.identified_["intra_node_latency_s"] is False
    assert model.identified_["intra_node_seconds_per_byte"] is True
    assert model.sync_coef_[0] == 3e-5
    assert "collinear" in model.notes_[0]
    measured_sync = synthetic([2], [8])["sync_s"][0]
    assert model.predict_parts([[2, 8, 2]])["sync_s"][0] == pytest.approx(measured_sync, rel=1e-6)


def test_sync_on_one_host_is_the_flat_collective_and_across_hosts_adds_one_among_the_hosts():
    G = GRAD_BYTES
    # ring: 8 ranks on one host; 8 ranks as 2 hosts x 4 (reduce-scatter/all-gather among 4, ring among 2)
    np.testing.assert_allclose(
        hierarchical_sync_features([8, 8], [8, 4], G, "ring"), [[14, 1.75 * G, 0, 0], [6, 1.5 * G, 2, G]]
    )
    # parameter server: each host's 4 ranks reduce to one, then the 2 hosts push to and pull from the server
    np.testing.assert_allclose(hierarchical_sync_features([8], [4], G, "parameter_server"), [[2, 8 * G, 2, 4 * G]])
    # one rank per node: nothing within a host
    np.testing.assert_allclose(hierarchical_sync_features([4], [1], G, "ring"), [[0, 0, 6, 1.5 * G]])


# Profiles on one host at 2 and 4 ranks, and on 2 and 4 hosts of 4 ranks each: both kinds at two sizes.
BOTH_KINDS = [(1, 1), (2, 2), (4, 4), (8, 4), (16, 4)]


def _both_kinds(**kw):
    ranks, per_host = np.array(BOTH_KINDS * 2).T
    return synthetic(ranks, [8] * len(BOTH_KINDS) + [64] * len(BOTH_KINDS), per_host, **kw)


def test_profiles_on_one_host_and_across_hosts_recover_all_four_sync_terms():
    model = fit(_both_kinds(), sync_prior=PRIOR)
    np.testing.assert_allclose(model.sync_coef_, TRUE["sync"], rtol=1e-6)
    assert [model.coefficients()[name] for name in SYNC_TERMS] == pytest.approx(list(TRUE["sync"]), rel=1e-6)
    assert all(model.identified_[name] for name in SYNC_TERMS)
    assert not model.notes_
    noisy = fit(_both_kinds(noise=0.01, seed=3), sync_prior=PRIOR)
    np.testing.assert_allclose(noisy.sync_coef_[[1, 3]], TRUE["sync"][[1, 3]], rtol=0.05)  # bandwidths


def test_profiles_on_one_host_fit_intra_terms_and_hold_inter_terms_at_the_priors():
    model = fit(synthetic(*grid_points(nodes=(1, 2, 4))), sync_prior=PRIOR)
    np.testing.assert_allclose(model.sync_coef_[:2], TRUE["sync"][:2], rtol=1e-6)
    assert model.coefficients()["inter_node_latency_s"] == 5e-5
    assert model.coefficients()["inter_node_seconds_per_byte"] == pytest.approx(1 / 10e9)
    assert model.identified_["intra_node_latency_s"] and model.identified_["intra_node_seconds_per_byte"]
    assert not model.identified_["inter_node_latency_s"] and not model.identified_["inter_node_seconds_per_byte"]
    assert model.notes_ == [
        "inter-node latency and bandwidth held at the priors 50.0 us per hop, 10.0 GB/s: no profile spans two hosts"
    ]


def test_a_candidate_spanning_hosts_is_predicted_with_the_inter_node_terms():
    # Fitted on both kinds: an unprofiled batch on 2 hosts of 4 ranks is the truth.
    model = fit(_both_kinds(), sync_prior=PRIOR)
    row = candidate_row({"nodes": 2, "per_device_batch": 32}, devices_per_node=4, launcher="slurm")
    assert row == [8, 32, 4]
    truth = synthetic([8], [32], [4])
    assert model.predict_parts([row])["sync_s"][0] == pytest.approx(truth["sync_s"][0], rel=1e-6)
    assert model.predict([row])[0] == pytest.approx(truth["y"][0], rel=1e-6)
    # Fitted on one host only (the local launcher): the same candidate's sync among 4 ranks comes from the
    # fitted intra terms, its sync between the 2 hosts from the inter priors.
    local = fit(synthetic(*grid_points(nodes=(1, 2, 4))), sync_prior=PRIOR)
    ring_of_4, ring_of_2 = 2 * 3 / 4 * GRAD_BYTES, 2 * 1 / 2 * GRAD_BYTES
    expected = 6 * TRUE["sync"][0] + ring_of_4 * TRUE["sync"][1] + 2 * 5e-5 + ring_of_2 / 10e9
    assert local.predict_parts([row])["sync_s"][0] == pytest.approx(expected, rel=1e-6)
    assert local.predict_parts([[8, 32, 8]])["sync_s"][0] == pytest.approx(synthetic([8], [32])["sync_s"][0], rel=1e-6)


def test_compute_growing_faster_than_linearly_is_still_fitted_through_its_extremes():
    # A chord of a convex curve would cross zero before b = 0: anchored at b0 it needs no negative coefficient.
    d = synthetic([1, 1], [32, 512], curvature=2e-6)
    model = fit(d)
    np.testing.assert_allclose(model.predict(d["X"]), d["y"], rtol=1e-9)
    assert not model.notes_


def test_compute_below_the_smallest_profiled_batch_is_held_no_lower_than_the_chord_to_the_origin():
    # Convex compute profiled at b = 32 and 512: the line through them crosses zero between 8 and 32, so an epoch's
    # small last step (b = 8) had a negative compute and a NaN step. No sample is computed faster than at b0 = 32.
    model = fit(synthetic([1, 1, 2, 2], [32, 512, 32, 512], curvature=2e-6))
    below, at_ref = model.predict_parts([[1, 8, 1], [2, 8, 2]]), model.predict_parts([[1, 32, 1], [2, 32, 2]])
    np.testing.assert_allclose(below["compute_s"], at_ref["compute_s"] * 8 / 32, rtol=1e-9)
    assert np.isfinite(below["step_s"]).all() and (below["step_s"] > below["data_s"]).all()
    # Where the line stays above the chord (compute linear, with a fixed part), it is followed below b0 as before.
    linear = fit(synthetic([1, 1], [32, 512]))
    np.testing.assert_allclose(linear.predict([[1, 8, 1]]), synthetic([1], [8])["y"], rtol=1e-9)


def test_coefficients_are_never_negative():
    X = np.array([[1, 8, 1], [1, 64, 1], [2, 8, 2], [2, 64, 2]])
    y = np.array([0.05, 0.01, 0.05, 0.01])  # time falling with batch: a negative slope would fit better
    model = PerfModel(grad_bytes=1e6).fit(X, y, data_s=y / 10, compute_s=y, sync_s=[0, 0, 0.001, 0.001])
    assert (
        min(
            model.coefficients()[k]
            for k in (
                "intercept_s",
                "per_sample_s",
                "contention_s",
                "contention_per_sample_s",
                *SYNC_TERMS,
            )
        )
        >= 0
    )


def test_one_disturbed_profile_does_not_bend_a_fit_with_spare_profiles():
    d = synthetic(*grid_points(nodes=(1, 2)))
    d["y"][3] *= 2.0  # another user's job ran through this profile
    model = fit(d)
    clean = synthetic(*grid_points(nodes=(1, 2)))["y"]
    errors = np.abs(model.predict(d["X"]) / clean - 1)
    assert np.median(errors) < 0.01 and np.delete(errors, 3).max() < 0.03


def test_uncertainty_grows_away_from_the_profiled_configurations():
    d = synthetic([1, 1, 2, 2], [8, 512, 8, 512])
    model = fit(d, discrepancy_per_octave=0.02)
    u_seen, u_middle, u_far = model.predict_uncertainty([[1, 8, 1], [1, 64, 1], [8, 64, 8]])
    assert u_seen < u_middle < u_far
    assert u_middle >= 0.02 * 3  # three octaves from b=8 and from b=512


def test_measurement_weight_is_inverse_variance_of_model_error_against_profile_noise():
    assert measurement_weight([0.06, 0.08], noise=0.05) == pytest.approx(0.005 / (0.005 + 0.0025))
    assert measurement_weight([], noise=0.05) == 0.0  # no spare profiles: the model passes through them anyway
    assert measurement_weight([0.0, 0.0], noise=0.05) == 0.0  # an exact model needs no measurement


def test_sync_no_profile_holds_is_predicted_at_the_prior_of_the_jobs_device():
    """Profiles on one host leave inter-node sync to the prior: NCCL's for a GPU job, gloo's (about 100 times
    slower) for a CPU job, each job's search.sync_prior filled by device; a model outside a job takes NCCL's."""
    from tests.conftest import job_config
    from tula_hpc.config import job_settings, validate_config
    from tula_hpc.performance.fitting import model_params
    from tula_hpc.performance.sync_priors import SYNC_PRIORS

    gpu_config = {**job_config(resources={"gpus_per_node": 1, "mem_gb": 16}), "launcher": "slurm"}
    jobs = {"cpu": default_job(), "gpu": job_settings(validate_config(gpu_config), "digits-cnn")}
    profiles = synthetic(*grid_points(nodes=(1, 2, 4)))
    for device, job in jobs.items():
        model = fit(profiles, sync_prior=model_params(job)["sync_prior"])
        inter = SYNC_PRIORS[device]["inter_node"]
        assert model.sync_coef_[2:] == pytest.approx([inter["latency_s"], 1e-9 / inter["bandwidth_gb_s"]])
    inter = SYNC_PRIORS["gpu"]["inter_node"]
    assert fit(profiles).sync_coef_[2:] == pytest.approx([inter["latency_s"], 1e-9 / inter["bandwidth_gb_s"]])


def test_latent_sync_and_overlap_are_recovered_from_full_steps_alone():
    """Profiles of the overlapped step alone (no sync part): sync's terms and g come from how much of sync the
    multi-rank steps leave exposed; hosts of 4 ranks, 2 to 16 of them, as on a GPU cluster."""
    nodes, batches = np.meshgrid([1, 2, 4, 8, 16], [8, 32, 128, 512])
    ranks, batch_column = 4 * nodes.ravel(), batches.ravel()
    d = synthetic(ranks, batch_column, per_host=np.full(ranks.shape, 4))
    model = PerfModel(grad_bytes=GRAD_BYTES, sync_prior=PRIOR, robust=False).fit(
        d["X"], d["y"], data_s=d["data_s"], compute_s=d["compute_s"]
    )
    assert model.sync_fit_ == "latent"
    assert model.overlap_gamma_ == pytest.approx(TRUE["gamma"], rel=1e-3)
    # one host size (4): intra latency held at its prior, so its bandwidth absorbs the difference
    assert model.sync_coef_[2:] == pytest.approx(TRUE["sync"][2:], rel=0.05)
    np.testing.assert_allclose(model.predict(d["X"]), d["y"], rtol=0.01)
    assert not model.identified_["intra_node_latency_s"] and model.identified_["inter_node_latency_s"]


def test_interference_of_the_all_reduce_with_backward_is_fitted_with_a_latent_sync_and_said():
    """As on the Pollux traces' T4s: compute beside the all-reduce runs 12 % slower than the profiles' compute parts
    (timed with no collective beside them). The latent fit gives i back and predicts every step within 1 %; a split
    fit, and a latent one with no step to spare after sync's terms and g, keep i at 0."""
    nodes, batches = np.meshgrid([1, 2, 4, 8, 16], [8, 32, 128, 512])
    ranks, batch, per_host = 4 * nodes.ravel(), batches.ravel(), np.full(nodes.size, 4)
    d = synthetic(ranks, batch, per_host=per_host)
    sync = hierarchical_sync_features(ranks, per_host, GRAD_BYTES, "ring") @ TRUE["sync"]
    gamma = TRUE["gamma"]
    steps = d["data_s"] + ((d["compute_s"] * 1.12) ** gamma + sync**gamma) ** (1 / gamma)
    model = PerfModel(grad_bytes=GRAD_BYTES, sync_prior=PRIOR, robust=False)
    model.fit(d["X"], steps, data_s=d["data_s"], compute_s=d["compute_s"])
    assert model.interference_ == pytest.approx(0.12, rel=0.02)
    assert model.coefficients()["interference"] == model.interference_
    np.testing.assert_allclose(model.predict(d["X"]), steps, rtol=0.01)
    assert any("multi-rank compute 12.0% slower than the profiles' compute parts" in note for note in model.notes_)
    split = PerfModel(grad_bytes=GRAD_BYTES, sync_prior=PRIOR, robust=False)
    assert split.fit(d["X"], steps, data_s=d["data_s"], compute_s=d["compute_s"], sync_s=sync).interference_ == 0.0
    few = [0, 4, 19]  # 1 and 16 hosts at b = 8, 16 hosts at b = 512: sync's terms and g take every step
    model.fit(d["X"][few], steps[few], data_s=d["data_s"][few], compute_s=d["compute_s"][few])
    assert model.interference_ == 0.0 and not any("slower than" in note for note in model.notes_)


def test_a_host_count_whose_sync_runs_off_the_line_is_predicted_at_its_own_level_and_others_by_the_line():
    """As the Pollux traces' 2-node steps: latent profiles at 1 to 16 hosts of 4 GPUs whose 2-host sync is twice the
    line's at every batch. The model keeps 2 hosts' own level, says so, and still predicts 6 hosts (never profiled)
    by the line."""
    nodes, batches = np.meshgrid([1, 2, 3, 4, 8, 16], [8, 32, 128, 512])
    ranks, batch = 4 * nodes.ravel(), batches.ravel()
    d = synthetic(ranks, batch, per_host=np.full(ranks.shape, 4))
    inter = hierarchical_sync_features(ranks, np.full(ranks.shape, 4), GRAD_BYTES, "ring")[:, 2:] @ TRUE["sync"][2:]
    data, compute = d["data_s"], d["compute_s"]
    sync = hierarchical_sync_features(ranks, np.full(ranks.shape, 4), GRAD_BYTES, "ring") @ TRUE["sync"]
    sync = sync + np.where(nodes.ravel() == 2, inter, 0.0)
    gamma = TRUE["gamma"]
    steps = data + (compute**gamma + sync**gamma) ** (1 / gamma)
    model = PerfModel(grad_bytes=GRAD_BYTES, sync_prior=PRIOR)  # Cauchy's loss: 2 hosts do not pull the line
    model.fit(d["X"], steps, data_s=data, compute_s=compute)
    assert list(model.inter_sync_levels_) == [2] and model.inter_sync_levels_[2] == pytest.approx(2.0, rel=0.02)
    np.testing.assert_allclose(model.predict(d["X"]), steps, rtol=0.01)
    assert model.coefficients()["inter_sync_levels"] == [{"hosts": 2, "over_line": model.inter_sync_levels_[2]}]
    assert any("inter-node sync at 2 hosts held at its own level, 2.0" in note for note in model.notes_)
    six_hosts = synthetic([24, 24], [32, 512], per_host=[4, 4])
    np.testing.assert_allclose(model.predict(six_hosts["X"]), six_hosts["y"], rtol=0.01)
    smooth = PerfModel(grad_bytes=GRAD_BYTES, sync_prior=PRIOR)
    assert smooth.fit(d["X"], d["y"], data_s=data, compute_s=compute).inter_sync_levels_ == {}


def test_one_host_count_off_the_line_is_set_aside_alone_not_every_one_its_pull_moved():
    """Sync timed alone (split), 2 hosts' twice the line's: fitted with 2 hosts in it the line misses 3 to 8 hosts
    too, each consistently; 2 hosts are set aside, the line fitted again, and 3 to 8 follow it."""
    nodes, batches = np.meshgrid([1, 2, 3, 4, 8], [8, 32, 128, 512])
    ranks, batch, per_host = 4 * nodes.ravel(), batches.ravel(), np.full(nodes.size, 4)
    d = synthetic(ranks, batch, per_host=per_host)
    features = hierarchical_sync_features(ranks, per_host, GRAD_BYTES, "ring")
    sync = features @ TRUE["sync"] + np.where(nodes.ravel() == 2, features[:, 2:] @ TRUE["sync"][2:], 0.0)
    steps = d["data_s"] + (d["compute_s"] ** TRUE["gamma"] + sync ** TRUE["gamma"]) ** (1 / TRUE["gamma"])
    model = PerfModel(grad_bytes=GRAD_BYTES, sync_prior=PRIOR)
    model.fit(d["X"], steps, data_s=d["data_s"], compute_s=d["compute_s"], sync_s=sync)
    assert model.sync_fit_ == "split" and list(model.inter_sync_levels_) == [2]
    assert model.inter_sync_levels_[2] == pytest.approx(2.0, rel=1e-3)
    assert model.sync_coef_[2:] == pytest.approx(TRUE["sync"][2:], rel=1e-3)


def test_split_parts_fit_split_and_a_missing_sync_part_makes_it_latent():
    d = synthetic(*grid_points())
    assert fit(d).sync_fit_ == "split"
    assert fit(d).coefficients()["sync_fit"] == "split"
    latent = PerfModel(grad_bytes=GRAD_BYTES).fit(d["X"], d["y"], data_s=d["data_s"], compute_s=d["compute_s"])
    assert latent.coefficients()["sync_fit"] == "latent"


def test_compute_follows_a_kink_the_profiles_show_and_not_noise():
    """Three or more profiled batches on one rank: compute passes through each where its neighbours predict each
    better than one line does (a kink), and stays one line where they do not (noise)."""
    batch = np.array([8, 16, 32, 64, 128, 256, 512, 1024])
    compute = 0.01 + 1e-5 * batch + 3e-4 * np.maximum(batch - 64, 0)  # a kink at 64
    X = np.column_stack([np.ones(8), batch, np.ones(8)])

    def fitted(rows, steps):
        return PerfModel(grad_bytes=GRAD_BYTES, robust=False).fit(X[rows], steps[rows], compute_s=steps[rows])

    np.testing.assert_allclose(fitted(slice(None), compute).predict(X), compute, rtol=1e-6)
    line = fitted([0, -1], compute)  # two batches: one line, which misses the kink by 150 %
    assert abs(line.predict(X[3:4])[0] / compute[3] - 1) > 1.0
    noisy = 0.01 + 1e-4 * batch * (1 + 0.1 * np.array([1, -1, 1, -1, 1, -1, 1, -1]))  # a line and 10 % noise
    assert fitted(slice(None), noisy).compute_kinks_[1].tolist() == [1.0]


def test_an_unfitted_or_misshapen_input_is_refused():
    from sklearn.exceptions import NotFittedError

    with pytest.raises(NotFittedError):
        PerfModel().predict([[1, 8, 1]])
    model = fit(synthetic(*grid_points()))
    with pytest.raises(ValueError, match="expected 3: ranks, per_device_batch, ranks_per_host"):
        model.predict([[1, 8]])
    with pytest.raises(ValueError, match="expected 3"):
        PerfModel().fit([[1, 8]], [0.1])


def test_leave_one_out_predicts_each_profile_from_the_others():
    from tula_hpc.performance.fitting import fit_profiles, leave_one_out, profile_row

    ranks, batch = grid_points(nodes=(1, 2, 4), batches=(8, 32, 128, 512))
    profiles = [profile_record(int(r), int(b), seed=i, noise=0.03) for i, (r, b) in enumerate(zip(ranks, batch))]
    settings = {"sync_prior": PRIOR, "noise_prior": 0.01}
    errors = leave_one_out(profiles, **settings)
    by_hand = []
    for i, held in enumerate(profiles):
        model = fit_profiles(profiles[:i] + profiles[i + 1 :], **settings)
        by_hand.append(abs(model.predict([profile_row(held)])[0] / held["median"]["step_s"] - 1))
    assert errors == pytest.approx(by_hand)
    assert 0 < np.median(errors) < 0.1


def test_uncertainty_never_falls_below_the_measurement_noise():
    model = fit(synthetic(*grid_points()), noise_prior=0.03)
    assert model.predict_uncertainty(model.profiled_).min() >= 0.03


def test_sync_fit_latent_sets_measured_sync_parts_aside_and_split_needs_them():
    d = synthetic(*grid_points())
    parts = {k: d[k] for k in ("data_s", "compute_s", "sync_s")}
    assert PerfModel(grad_bytes=GRAD_BYTES, sync_fit="latent").fit(d["X"], d["y"], **parts).sync_fit_ == "latent"
    with pytest.raises(ValueError, match="sync_fit 'split' needs sync_s"):
        PerfModel(grad_bytes=GRAD_BYTES, sync_fit="split").fit(d["X"], d["y"], compute_s=d["compute_s"])
    with pytest.raises(ValueError, match="unknown sync_fit 'hidden'; allowed: auto, split, latent"):
        PerfModel(sync_fit="hidden").fit(d["X"], d["y"], **parts)

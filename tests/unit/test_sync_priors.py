"""The performance model's presets: one per device kind, each naming every sync kind's two terms."""

from tula_hpc.performance.sync_priors import FIT_DEFAULTS, SYNC_KINDS, SYNC_PRIORS, sync_device


def test_a_job_with_gpus_gets_nccl_preset_and_a_cpu_job_the_gloo_one():
    assert sync_device(4) == "gpu" and sync_device(0) == "cpu"


def test_every_preset_names_both_sync_kinds_with_positive_terms_and_a_fit_default():
    assert set(SYNC_PRIORS) == set(FIT_DEFAULTS) == {"gpu", "cpu"}
    for prior in SYNC_PRIORS.values():
        assert tuple(prior) == SYNC_KINDS
        assert all(terms["latency_s"] > 0 and terms["bandwidth_gb_s"] > 0 for terms in prior.values())
    assert SYNC_PRIORS["gpu"]["intra_node"]["bandwidth_gb_s"] > SYNC_PRIORS["cpu"]["intra_node"]["bandwidth_gb_s"]

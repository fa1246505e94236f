"""What a run costs under each pricing model."""

import dataclasses

from tests.conftest import default_job
from tula_hpc.core.job import ObjectiveSettings
from tula_hpc.performance.pricing import charge_factor, costs, device_memory_gb

MEMORY = {"fit": {"intercept_bytes": 2e9, "slope_bytes_per_sample": 1e7}}


def objective(**changes) -> ObjectiveSettings:
    """The default job's objective, `changes` replaced."""
    return dataclasses.replace(default_job().objective, **changes)


def test_costs_count_each_pricing_from_time_nodes_and_memory():
    prices = objective(price_per_node_hour=2.0, price_per_gb_hour=0.25, charge_factors={"default": 1.5})
    # 2 hours on 4 nodes of 2 ranks, each rank holding 3 GB at 100 samples per device.
    assert costs(7200, 4, 8, 100, prices, MEMORY, None) == {"node_hour": 16.0, "memory": 12.0, "service_units": 12.0}


def test_device_memory_grows_with_the_per_device_batch_along_the_memory_line():
    assert device_memory_gb(MEMORY, 0) == 2.0 and device_memory_gb(MEMORY, 100) == 3.0


def test_a_partition_is_charged_its_own_factor_else_the_default_else_nothing():
    both, gpu_only = objective(charge_factors={"gpu": 4.0, "default": 1.0}), objective(charge_factors={"gpu": 4.0})
    assert charge_factor(both, "gpu") == 4.0
    assert charge_factor(both, "debug") == 1.0
    assert charge_factor(both, None) == 1.0
    assert charge_factor(gpu_only, "debug") is None
    assert costs(3600, 1, 1, 0, gpu_only, MEMORY, "debug")["service_units"] is None

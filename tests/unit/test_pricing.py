"""What a run costs under each pricing model."""

from tula_hpc.pricing import charge_factor, costs, device_memory_gb

MEMORY = {"fit": {"intercept_bytes": 2e9, "slope_bytes_per_sample": 1e7}}


def test_costs_count_each_pricing_from_time_nodes_and_memory():
    objective = {"price_per_node_hour": 2.0, "price_per_gb_hour": 0.25, "charge_factors": {"default": 1.5}}
    # 2 hours on 4 nodes of 2 ranks, each rank holding 3 GB at 100 samples per device.
    assert costs(7200, 4, 8, 100, objective, MEMORY, None) == {"node_hour": 16.0, "memory": 12.0, "service_units": 12.0}


def test_device_memory_grows_with_the_per_device_batch_along_the_memory_line():
    assert device_memory_gb(MEMORY, 0) == 2.0 and device_memory_gb(MEMORY, 100) == 3.0


def test_a_partition_is_charged_its_own_factor_else_the_default_else_nothing():
    assert charge_factor({"charge_factors": {"gpu": 4.0, "default": 1.0}}, "gpu") == 4.0
    assert charge_factor({"charge_factors": {"gpu": 4.0, "default": 1.0}}, "debug") == 1.0
    assert charge_factor({"charge_factors": {"gpu": 4.0, "default": 1.0}}, None) == 1.0
    assert charge_factor({"charge_factors": {"gpu": 4.0}}, "debug") is None
    objective = {"price_per_node_hour": 1.0, "price_per_gb_hour": 1.0, "charge_factors": {"gpu": 4.0}}
    assert costs(3600, 1, 1, 0, objective, MEMORY, "debug")["service_units"] is None

"""What a run costs under each pricing model."""

from tula_hpc.pricing import costs


def test_costs_count_each_pricing_from_time_nodes_and_memory():
    memory = {"fit": {"intercept_bytes": 2e9, "slope_bytes_per_sample": 0.0}}
    objective = {"price_per_node_hour": 2.0, "price_per_gb_hour": 0.25, "charge_factors": {"default": 1.5}}
    assert costs(7200, 4, 8, 32, objective, memory, None) == {"node_hour": 16.0, "memory": 8.0, "service_units": 12.0}

"""What a run costs under each pricing model (paper Eq. 4b and IV-C-2): node-hours, GB-hours of device
memory, HPC service units. The same function prices a prediction (fit_model) and a measurement (evaluate).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tula_hpc.memory.device_budget import GB

if TYPE_CHECKING:
    from tula_hpc.core.job import ObjectiveSettings

HOUR_S = 3600.0


def device_memory_gb(memory: dict, per_device_batch: int) -> float:
    """Peak device memory of a training step at this batch, from memory.json's line (parameters, optimiser
    state and DDP buckets are in its intercept)."""
    fit = memory["fit"]
    return (fit["intercept_bytes"] + fit["slope_bytes_per_sample"] * per_device_batch) / GB


def charge_factor(objective: ObjectiveSettings, partition: str | None) -> float | None:
    """Service units per node-hour on `partition` (its own factor, else `default`; None if neither)."""
    factors = objective.charge_factors
    return factors.get(partition, factors.get("default")) if partition else factors.get("default")


def costs(
    time_s: float,
    nodes: int,
    ranks: int,
    per_device_batch: int,
    objective: ObjectiveSettings,
    memory: dict,
    partition: str | None,
) -> dict[str, float | None]:
    """Cost of a run under each pricing model: node-hours, GB-hours of device memory, service units."""
    hours = time_s / HOUR_S
    factor = charge_factor(objective, partition)
    return {
        "node_hour": hours * nodes * objective.price_per_node_hour,
        "memory": hours * ranks * device_memory_gb(memory, per_device_batch) * objective.price_per_gb_hour,
        "service_units": None if factor is None else hours * nodes * factor,
    }

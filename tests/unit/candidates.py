"""Predicted candidates as perfmodel.json holds them, for the tests of the choice and of the select stage."""

from tests.conftest import default_job


def candidate(nodes, batch, time_s, cost, rel_uncertainty=0.0):
    """A predicted candidate; no noise unless given, so that no two tie (choice.TIE_SIGMAS)."""
    return {
        "nodes": nodes,
        "batch": batch,
        "per_device_batch": batch // nodes,
        "time_s": time_s,
        "cost": cost,
        "rel_uncertainty": rel_uncertainty,
    }


def perfmodel(candidates):
    """perfmodel.json holding `candidates`."""
    fitted = {"params": {}, "identified": {}, "notes": [], "grad_bytes": 1.0, "train_samples": 1000, "epochs": 1}
    search = {"mode": "full", "history": [], "stopped": None}
    rest = {"profiled": [], "search": search, "leave_one_out": {}, "measurement_weight": 0.0, "noise_scale": None}
    return {
        "job": "digits-cnn",
        "collective": "ring",
        "pricing": "node_hour",
        **fitted,
        **rest,
        "candidates": candidates,
    }


def objective(**changes):
    """The default job's objective (kneedle, a 10 % model-knee saving, no constraints), minimising time."""
    return default_job(objective={"minimize": "time", **changes}).objective


def curve(a, c, batches, nodes=1):
    return [candidate(nodes, b, a / b + c, nodes * (a / b + c)) for b in batches]


# A hand-made model: more nodes are faster and dearer; time falls as a/B + c with a, c shrinking with N.
BATCHES = [2**k for k in range(5, 12)]
GRID = curve(1000.0, 10.0, BATCHES, nodes=1) + curve(600.0, 6.0, BATCHES, nodes=2) + curve(400.0, 4.0, BATCHES, nodes=4)

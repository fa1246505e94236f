"""Stage plan: the candidate grid of (nodes, global batch)."""

from tula_hpc.plan import candidate_grid

SEARCH = {"nodes": {"min": 1, "max": 4}, "batch": {"min": 32, "max": "auto"}}


def test_grid_doubles_nodes_and_batches_within_memory_and_data():
    grid = candidate_grid(SEARCH, devices_per_node=1, max_batch_per_device=64, train_samples=10_000)
    pairs = {(c["nodes"], c["batch"]) for c in grid}
    assert pairs == {(1, 32), (1, 64), (2, 32), (2, 64), (2, 128), (4, 32), (4, 64), (4, 128), (4, 256)}
    assert all(c["per_device_batch"] * c["nodes"] == c["batch"] for c in grid)


def test_grid_respects_explicit_max_devices_and_training_set():
    search = {"nodes": {"min": 2, "max": 2}, "batch": {"min": 16, "max": 1024}}
    grid = candidate_grid(search, devices_per_node=4, max_batch_per_device=1000, train_samples=300)
    assert [c["batch"] for c in grid] == [16, 32, 64, 128, 256]
    assert [c["per_device_batch"] for c in grid] == [2, 4, 8, 16, 32]

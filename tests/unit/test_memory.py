import numpy as np
import pytest

from tula_hpc.memory import GB, LinearMemoryModel, summarise
from tula_hpc.stage import StageError


def test_linear_fit_recovers_intercept_and_slope():
    batches = np.array([8, 16, 32, 64])
    model = LinearMemoryModel().fit(batches, 5e6 + 4.5e5 * batches)
    assert model.intercept_ == pytest.approx(5e6)
    assert model.slope_ == pytest.approx(4.5e5)
    assert model.predict([512])[0] == pytest.approx(5e6 + 4.5e5 * 512)


def test_max_batch_is_the_largest_that_fits():
    model = LinearMemoryModel().fit([1, 2, 3], [100 + 10, 100 + 20, 100 + 30])
    assert model.max_batch(200) == 10
    assert model.max_batch(209) == 10
    assert model.max_batch(50) == 0


def _job(device_memory_gb, headroom=0.1):
    return {"name": "j", "model": {"name": "tiny_cnn"},
            "resources": {"device_memory_gb": device_memory_gb, "memory_headroom": headroom}}


def _measured(intercept=1e7, slope=5e4, params=6e5):
    probes = [{"batch": b, "measured_peak_bytes": intercept + slope * b, "param_bytes": params} for b in (16, 32, 64)]
    return {"probes": probes, "dataset": {"train": 1000, "val": 100, "test": 100}}


def test_summary_sizes_the_batch_for_the_budget_and_headroom():
    result = summarise(_job(1.0, headroom=0.1), _measured())
    assert abs(result["max_batch_per_device"] - (0.9 * GB - 6e5 - 1e7) / 5e4) <= 1
    assert result["fit"] == {"intercept_bytes": pytest.approx(1e7), "slope_bytes_per_sample": pytest.approx(5e4)}


def test_budget_smaller_than_the_model_is_a_clear_error():
    with pytest.raises(StageError, match=r"job 'j': field 'resources.device_memory_gb': .* needs \d+ bytes"):
        summarise(_job(0.005), _measured())

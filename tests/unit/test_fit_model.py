"""Stage fit_model: the profiles' rows in perfmodel.json, a text job's with its rate in tokens beside samples."""

from tula_hpc.stages.fit_model import _profiled


def _profile(**extra) -> dict:
    return {
        "nodes": 1,
        "gpus_per_node": 1,
        "global_batch": 8,
        "per_device_batch": 8,
        "median": {"step_s": 0.1},
        "iqr_over_median": {"step_s": 0.02},
        "samples_per_s": 80.0,
        **extra,
    }


def test_a_text_profile_s_row_carries_samples_and_tokens_per_second_an_image_profile_s_row_stays_as_it_was():
    image, text = _profiled([_profile(), _profile(seq_len=64, tokens_per_s=5120.0)], [0.1, 0.1])
    assert "samples_per_s" not in image and "tokens_per_s" not in image
    assert text["samples_per_s"] == 80.0 and text["tokens_per_s"] == 5120.0

"""progress.py: AdaScale's gain, the steps to the recipe's progress at a noise scale, the profiles' noise scale."""

from dataclasses import replace

import pytest

from tests.conftest import default_job
from tula_hpc.training.progress import (
    adascale_gain,
    measured_noise_scale,
    recipe_steps,
    run_epochs,
    run_steps,
    steps_to_progress,
    whole_epochs,
)


def test_adascale_gain_runs_from_one_without_noise_to_the_scale_with_only_noise():
    assert adascale_gain(1.0, 0.0, 32) == 1.0
    assert adascale_gain(0.0, 1.0, 32) == pytest.approx(32.0)
    # McCandlish's form: B_noise = 512 at a base batch of 128, a batch of 4096 (s = 32)
    gradient_sq, b_noise, base = 2.0, 512.0, 128
    gain = adascale_gain(gradient_sq, b_noise * gradient_sq / base, 4096 / base)
    assert gain == pytest.approx((1 + b_noise / base) / (1 + b_noise / 4096))


def test_steps_to_the_same_progress_follow_the_noise_scale():
    assert steps_to_progress(1000, 0.0, 128, 4096) == 1000  # no noise: every batch needs the recipe's steps
    assert steps_to_progress(1000, 512.0, 128, 128) == 1000
    # far below B_noise a batch 32x larger needs nearly 32x fewer steps; far above it, no fewer
    assert steps_to_progress(1000, 1e9, 128, 4096) == pytest.approx(1000 / 32, rel=1e-4)
    assert steps_to_progress(1000, 512.0, 128, 4096) == pytest.approx(1000 * (1 + 512 / 4096) / (1 + 512 / 128))


def test_the_profiles_noise_scale_is_the_median_of_those_that_measured_one():
    profiles = [{"noise_scale": None}, {}, *({"noise_scale": {"b_noise": b}} for b in (100.0, 300.0, 200.0, 900.0))]
    assert measured_noise_scale(profiles) == {"b_noise": 250.0, "profiles": 4, "range": [100.0, 900.0]}
    assert measured_noise_scale([{"noise_scale": None}]) is None


TRAIN = default_job().train  # epochs, tokens and steps replaced below, past validation (tokens needs data.seq_len)


def test_a_run_is_measured_in_tokens_steps_or_epochs():
    def length(**train):
        return run_epochs(replace(TRAIN, **train), 1000, 50, 64)

    assert length(epochs=3) == 3.0
    assert length(tokens=32_000) == pytest.approx(0.5)  # 32,000 tokens over 1,000 windows of 64
    assert length(tokens=160_000) == pytest.approx(2.5)
    assert length(steps=30) == pytest.approx(1.5)  # 30 steps of 50 samples over 1,000
    assert [whole_epochs(e) for e in (0.5, 1.0, 2.5, 3.0000000001)] == [1, 1, 3, 3]


def test_a_run_s_steps_are_train_steps_as_given_else_its_epochs_of_steps_rounded_up():
    def steps(**train):
        return run_steps(replace(TRAIN, **train), 1000, 50, 64, steps_per_epoch=20)

    assert steps(steps=7) == 7
    assert steps(epochs=3) == 60
    assert steps(tokens=32_000) == 10
    assert steps(tokens=33_000) == 11  # 10.3 steps: the part-step is a step


def test_the_recipe_s_steps_are_its_run_at_lr_base_batch_in_tokens_steps_or_epochs():
    """AdaScale trains to these, so a run measured in tokens must not train train.epochs' worth (the default 3)."""

    def steps(**train):
        return recipe_steps(replace(TRAIN, lr_base_batch=16, **train), 1000, 64)

    assert steps(epochs=3) == 3 * 63  # ceil(1000 / 16) steps an epoch
    assert steps(tokens=64_000) == 63  # one epoch of 64-token windows
    assert steps(tokens=32_000) == 32  # half an epoch, the part-step a step
    assert steps(steps=40) == 40

"""train.batch_schedule: the goodput choice at the noise scale measured so far, on a step model with a known optimum,
and the combinations validation refuses."""

import pytest

from tests.conftest import default_job, job_config
from tula_hpc.config import ConfigError, validate_config
from tula_hpc.core.run_layout import steps_per_epoch
from tula_hpc.performance.batch_schedule import BatchRamp, BatchSchedule, goodput_choice
from tula_hpc.training.progress import steps_to_progress

SAMPLES = 48_000
LATENCY_S, PER_SAMPLE_S = 4e-3, 5.5e-5  # a step of B samples takes a + c B (2 CPU ranks, bn_cnn at 14x14)
BATCHES = [32, 64, 128, 256, 512, 1024]


def rows(nodes: int = 2, epochs: int = 6, latency_s: float = LATENCY_S) -> list[dict]:
    """Predicted candidates on `nodes` ranks as perfmodel.json holds them, steps only (no warm-up, no epoch start)."""
    found = []
    for batch in BATCHES:
        per_epoch = steps_per_epoch(SAMPLES, nodes, batch // nodes)
        step = latency_s + PER_SAMPLE_S * batch
        time_s = epochs * per_epoch * step
        found.append(
            dict(
                nodes=nodes,
                gpus_per_node=0,
                batch=batch,
                per_device_batch=batch // nodes,
                step_s=step,
                steps_per_epoch=per_epoch,
                warmup_s=0.0,
                epoch_start_s=0.0,
                time_s=time_s,
                cost=nodes * time_s / 3600,
                rel_uncertainty=0.0,
            )
        )
    return found


def fastest_to_progress(b_noise: float, latency_s: float = LATENCY_S) -> int:
    """The known answer: steps to the recipe's progress (McCandlish) times the step, smallest over the grid."""
    return min(BATCHES, key=lambda b: steps_to_progress(1.0, b_noise, 128, b) * (latency_s + PER_SAMPLE_S * b))


def goodput_job(**objective):
    return default_job(
        train={"batch_schedule": "adaptive", "strategy": "adascale", "lr_base_batch": 128},
        objective={"minimize": "goodput", **objective},
    )


@pytest.mark.parametrize("b_noise", [20.0, 72.0, 300.0, 2000.0])
def test_the_choice_follows_the_noise_scale_to_the_known_optimum(b_noise):
    """time to progress ~ (1 + B_noise / B)(a + c B), least near B = sqrt(a B_noise / c): a larger noise scale, a
    larger batch."""
    chosen = goodput_choice(goodput_job(), rows(), SAMPLES, b_noise)
    assert chosen["batch"] == fastest_to_progress(b_noise)


def test_the_noise_scale_growing_during_training_moves_the_batch_up():
    schedule = BatchSchedule(goodput_job(), tuple(rows()), SAMPLES)
    early, late = schedule.choose(64, {"b_noise": 72.0}), schedule.choose(64, {"b_noise": 300.0})
    assert (early["global_batch"], late["global_batch"]) == (64, 128)
    assert late == {"global_batch": 128, "b_noise": 300.0, "reason": "goodput"}
    assert schedule.start(64) == 64  # it starts at the selected batch


def test_without_a_noise_scale_or_a_feasible_candidate_the_batch_stays():
    schedule = BatchSchedule(goodput_job(), tuple(rows()), SAMPLES)
    assert schedule.choose(256, None)["global_batch"] == 256
    assert schedule.choose(256, {"b_noise": None})["reason"] == "no noise scale measured"
    capped = BatchSchedule(goodput_job(deadline_s=1.0), tuple(rows()), SAMPLES).choose(256, {"b_noise": 300.0})
    assert capped["global_batch"] == 256 and capped["reason"].startswith("kept: no candidate meets the constraints")


def test_a_time_objective_is_followed_by_goodput_and_goodput_cost_by_itself():
    time_job = default_job(train={"batch_schedule": "adaptive"}, objective={"minimize": "time"})
    assert goodput_choice(time_job, rows(), SAMPLES, 300.0)["batch"] == fastest_to_progress(300.0)
    cost_job = goodput_job(minimize="goodput_cost")
    assert goodput_choice(cost_job, rows(), SAMPLES, 300.0)["batch"] == fastest_to_progress(300.0)  # cost ~ time


def test_the_schedule_takes_the_candidates_at_the_node_shape_the_run_holds():
    perfmodel = {"candidates": rows(nodes=1) + rows(nodes=2), "train_samples": SAMPLES}
    schedule = BatchSchedule.for_run(goodput_job(), perfmodel, {"nodes": 2, "gpus_per_node": 0, "batch": 64})
    assert {r["nodes"] for r in schedule.rows} == {2} and len(schedule.rows) == len(BATCHES)
    with pytest.raises(ValueError, match=r"no candidate at the selected nodes/GPUs per node \(4, 0\)"):
        BatchSchedule.for_run(goodput_job(), perfmodel, {"nodes": 4, "gpus_per_node": 0, "batch": 64})


def test_validation_refuses_polo_and_a_search_over_one_rank():
    polo = job_config(train={"batch_schedule": "adaptive", "strategy": "polo", "polo": {"sync_epochs": 1}})
    with pytest.raises(ConfigError, match=r"field 'train.batch_schedule': adaptive with strategy 'polo': its local"):
        validate_config(polo)
    one_rank = job_config(train={"batch_schedule": "adaptive"}, search={"nodes": {"min": 1, "max": 1}})
    with pytest.raises(ConfigError, match=r"field 'train.batch_schedule': adaptive on at most 1 rank"):
        validate_config(one_rank)
    with pytest.raises(ConfigError, match=r"train.batch_schedule"):
        validate_config(job_config(train={"batch_schedule": "sometimes"}))
    assert default_job().train.batch_schedule == "fixed"


def test_the_ramp_doubles_in_equal_stretches_over_its_fraction_then_holds_the_selected_batch():
    ramp = BatchRamp(16, 128, 0.2)
    assert ramp.batches() == [16, 32, 64, 128] and ramp.start(128) == 16  # the selected batch is where it ends
    places = [0.0, 0.066, 0.067, 0.133, 0.134, 0.199, 0.2, 0.9]
    assert [ramp.batch_at(p) for p in places] == [16, 16, 32, 32, 64, 64, 128, 128]
    assert ramp.due(0.066, 0.067) and not ramp.due(0.07, 0.13) and ramp.due(0.19, 0.21)
    choice = ramp.choose(16, {"b_noise": 40.0}, 0.1)
    assert choice == {"global_batch": 32, "b_noise": 40.0, "reason": "ramp"}
    assert BatchRamp(16, 100, 0.2).batches() == [16, 32, 64, 100]  # the last doubling capped at the selected batch
    assert BatchRamp(64, 64, 0.2).batch_at(0.0) == 64  # nothing to ramp


def test_a_ramp_from_above_the_selected_batch_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="train.ramp.start_batch.*256.*selected batch 128"):
        BatchRamp(256, 128, 0.2)


def test_the_stage_builds_the_ramp_from_lr_base_batch_and_refuses_one_that_does_not_split_over_the_ranks():
    job = default_job(train=dict(batch_schedule="ramp", lr_base_batch=48))
    assert BatchRamp.for_run(job, 256, 2).batches() == [48, 96, 192, 256]
    with pytest.raises(ValueError, match=r"train.ramp.start_batch.*\[48, 96, 192, 256\].*over 5 ranks"):
        BatchRamp.for_run(job, 256, 5)


def test_adaptive_decides_at_every_share_of_the_run_it_is_given():
    schedule = BatchSchedule(default_job(), tuple(rows()), SAMPLES, every=0.25)
    assert [schedule.due(a / 10, b / 10) for a, b in [(0, 2), (2, 3), (5, 7), (9, 10)]] == [False, True, False, True]

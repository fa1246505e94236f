"""The report's training section on a synthetic summary: the noise-scale panel and what the batch costs."""

from tula_hpc.core.records import TrainSummary
from tula_hpc.performance.epochs import compare_epochs
from tula_hpc.reporting.figures import link
from tula_hpc.reporting.training_section import noise_scale_line, strategy_section, time_terms


def _summary(noise) -> TrainSummary:
    history = [{"epoch": e, "val_accuracy": 0.5 + 0.1 * e, "loss": 1.0 / e, "noise_scale": noise(e)} for e in (1, 2, 3)]
    return TrainSummary(
        nodes=2,
        global_batch=512,
        per_device_batch=256,
        world_size=2,
        accumulation=1,
        micro_batch=256,
        epochs=3,
        steps=9,
        steps_per_epoch=3,
        strategy="lbt",
        train_samples=4608,
        train_time_s=3.0,
        resumed_from_epoch=None,
        resumed_from_step=None,
        restarts_at_steps=[],
        history=history,
        train_time_with_lost_work_s=3.0,
        wall_time_s=4.0,
    )


def test_the_noise_scale_is_plotted_and_its_cost_at_the_trained_batch_said(tmp_path):
    summary = _summary(lambda e: {"b_noise": 128.0 * e, "gradient_sq": 1.0, "trace_sigma": 128.0 * e, "steps": 9})
    section = strategy_section(summary, tmp_path / "training.png", tmp_path / "report.md")
    assert (tmp_path / "training.png").read_bytes()[:4] == b"\x89PNG"
    assert "Gradient noise scale at epoch 3: B_noise = 384." in section
    assert "1 + B / B_noise = 2.33 times the samples" in section and "1 + B_noise / B = 1.75 times the steps" in section


def test_without_a_noise_scale_the_section_says_why():
    assert "on two ranks or more" in noise_scale_line([], 512)
    assert "B_noise" in noise_scale_line([(1, 100.0)], 512)


def test_links_are_relative_to_the_report(tmp_path):
    assert link(tmp_path / "plots" / "a.png", tmp_path / "report.md") == "plots/a.png"


def test_the_time_beside_the_steps_is_shown_apart_with_the_first_and_steady_epochs():
    chosen = {"warmup_first_s": 0.6, "warmup_second_s": 0.4, "epoch_start_s": 0.03, "outside_epoch_s": 0.2}
    evaluation = compare_epochs([0.8, 0.5, 0.16], [0.72, 0.55, 0.15])
    text = time_terms(chosen, {"job_time_s": 2.1}, evaluation)
    assert "a warm-up of 1.000 s once (0.600 s in the first epoch, 0.400 s in the second)" in text
    assert "0.030 s at each later epoch's start" in text and "0.200 s at each epoch's end" in text
    assert "2.10 s in all" in text
    assert "First epoch: predicted 0.720 s, measured 0.800 s (-10%)" in text
    assert "steady epochs: predicted 0.150 s, measured 0.160 s (-6%)" in text
    assert "First epoch: not measured" in time_terms({}, {}, {})  # records made before these were predicted


def test_an_adaptive_schedule_plots_the_batch_beside_the_noise_scale_and_lists_its_changes(tmp_path):
    summary = _summary(lambda e: {"b_noise": 100.0 * e, "gradient_sq": 1.0, "trace_sigma": 100.0 * e, "steps": 9})
    ran, following = [128, 256, 256], [256, 256, 512]
    history = [
        {
            **h,
            "batch_schedule": {
                "ran": {"global_batch": r},
                "global_batch": n,
                "b_noise": 100.0 * h["epoch"],
                "reason": "goodput",
                "next": {"global_batch": n},
            },
        }
        for h, r, n in zip(summary.history, ran, following)
    ]
    adaptive = TrainSummary.from_dict({**summary.as_dict(), "history": history})
    section = strategy_section(adaptive, tmp_path / "training.png", tmp_path / "report.md")
    assert (tmp_path / "training.png").read_bytes()[:4] == b"\x89PNG"
    assert "Batch schedule `adaptive`" in section and "started at 128" in section
    assert "128 -> 256 after epoch 1 (B_noise 100); 256 -> 512 after epoch 3 (B_noise 300)" in section
    assert "Batch schedule" not in strategy_section(summary, tmp_path / "fixed.png", tmp_path / "report.md")


def test_the_batch_schedule_line_says_after_which_step_a_change_mid_epoch_fell():
    from tula_hpc.reporting.training_section import batch_schedule_line

    def decision(ran: int, now: int) -> dict:
        return {
            "ran": {"global_batch": ran},
            "global_batch": now,
            "b_noise": None,
            "reason": "ramp",
            "next": {"global_batch": now},
        }

    history = [
        {"kind": "batch_schedule", "step": 40, "epoch": 0, "batch_schedule": decision(16, 32)},
        {"epoch": 1, "step": 60, "batch_schedule": decision(32, 64)},
    ]
    line = batch_schedule_line(history)
    assert "`ramp`" in line and "16 -> 32 after step 40" in line and "32 -> 64 after epoch 1" in line

"""The report's outcome section: predicted against measured time and cost, the test scores in the task's words,
restarts and relaunches after running out of memory, and training's loading and device memory against what the
profiles and the memory model said."""

from __future__ import annotations

from tula_hpc.core.records import Selection, TrainSummary
from tula_hpc.reporting.task_words import TaskWords
from tula_hpc.reporting.training_section import time_terms


def _loading(selection: Selection, summary: TrainSummary) -> str:
    """Training's wait for its loader beside the profiles' data part: the profiles synchronise every step, so
    their loading cannot overlap the device's work, while training's can (on a GPU); the gap shows how much."""
    waited = sum(r["data_wait_s"] for r in summary.epoch_history)
    chosen = selection.chosen
    text = (
        f"Data loading: training waited {waited:.2f} s for its loader ({waited / summary.train_time_s:.1%} of "
        f"the steps' time); the profiles' synchronised steps load for {chosen['data_s'] / chosen['step_s']:.1%} of "
        f"a step at this configuration."
    )
    if chosen.get("loader_s"):  # the workers' pace (performance/loader_rate.py), where profiles timed it
        loader_ms, step_ms = chosen["loader_s"] * 1e3, chosen["model_step_s"] * 1e3
        pace = "keeps up."
        if chosen["loader_bound"]:
            pace = (
                "sets the pace; more loader workers (data.num_workers, resources.cpus_per_task) or cheaper loading "
                f"would save up to {loader_ms - step_ms:.1f} ms a step."
            )
        text += f" Its workers make a batch every {loader_ms:.1f} ms against a predicted {step_ms:.1f} ms step: "
        text += f"the loader {pace}"
    return text


def _device_memory(memory: dict, summary: TrainSummary) -> str:
    """The device as training found it against the memory model at the batch each device computed at once."""
    fit, micro_batch = memory["fit"], summary.micro_batch
    predicted = fit["intercept_bytes"] + fit["slope_bytes_per_sample"] * micro_batch
    held = f"{summary.peak_reserved_bytes / 1e6:.2f} MB (reserved)"
    if summary.peak_allocated_bytes is not None:  # runs before the allocated figure was recorded have the reserved
        allocated, reserved = summary.peak_allocated_bytes / 1e6, summary.peak_reserved_bytes / 1e6
        held = f"{allocated:.2f} MB allocated ({reserved:.2f} MB reserved)"
    text = (
        f"Training's peak device memory {held} against {predicted / 1e6:.2f} MB the memory model predicts at "
        f"{micro_batch} samples per device at once."
    )
    if summary.outside_allocator_bytes:
        assumed = memory["outside_allocator_bytes"] + memory["collective_buffer_bytes"]
        outside = summary.outside_allocator_bytes
        text += (
            f" Held outside the allocator (CUDA context, NCCL's communicators) {outside / 1e6:.1f} MB in training, "
            f"against {assumed / 1e6:.1f} MB the probes measured and reserved for NCCL's ring."
        )
    return text


def _restarts(steps: list[int], steps_per_epoch: int) -> str:
    """Where training resumed from a checkpoint, as epoch and step within it (a preemption saves mid-epoch)."""
    if not steps:
        return ""
    places = ", ".join(f"step {s} (epoch {s // steps_per_epoch + 1}, step {s % steps_per_epoch})" for s in steps)
    return f"; resumed from its checkpoint at {places}"


def _attempts(summary: TrainSummary) -> str:
    """One line when training ran out of memory and was relaunched (train/summary.json's attempts)."""
    attempts = summary.attempts or []
    if len(attempts) < 2:
        return ""
    tried = "; ".join(
        f"global batch {a['global_batch']}, {a['per_device_batch']} per device as {a['accumulation']} x "
        f"{a['micro_batch']}: {a['outcome'].replace('_', ' ')}"
        for a in attempts
    )
    ended = [a["noticed_after_s"] for a in attempts if "noticed_after_s" in a]
    known = f" (each time known here at most {max(ended):.1f} s after the rank recorded it)" if ended else ""
    return f"Training ran out of memory and was relaunched from its checkpoint{known}: {tried}.\n"


def _test_scores(evaluation: dict) -> str:
    """The headline test score in the task's words (TaskWords), as trained beside it, then the task's other scores."""
    words = TaskWords.of(evaluation)
    headline = words.headline
    score = evaluation[f"test_{headline}"]
    as_trained = evaluation.get(f"test_{headline}_as_trained", score)
    return (
        f"Test {words.label(headline)} **{words.value(headline, score)}**\non {evaluation['test_samples']} "
        f"{words.sample_noun}s (BatchNorm statistics recomputed on the training set; as trained\n"
        f"{words.value(headline, as_trained)}){words.test_scores(evaluation)}"
    )


def outcome_section(
    links: dict[str, str], memory: dict, selection: Selection, summary: TrainSummary, evaluation: dict
) -> str:
    """How the chosen run went against its prediction; `links` holds the plots' links relative to the report."""
    restarts = summary.restarts_at_steps
    return f"""## Outcome
| | predicted | measured |
|---|---|---|
| training time (s, the epochs: steps, warm-up, epoch starts) | {evaluation["predicted_train_time_s"]:.2f} | {
        evaluation["measured_train_time_s"]:.2f} |
| cost ({evaluation["pricing"]}, the epochs) | {evaluation["predicted_cost"]:.5f} | {evaluation["measured_cost"]:.5f} |
| with work lost to kills and OOM | | {evaluation["measured_train_time_with_lost_work_s"]:.2f} s, {
        evaluation["measured_cost_with_lost_work"]:.5f} |

Relative time error {evaluation["time_rel_error"]:+.1%}. {
        time_terms(selection.chosen, selection.predicted or {}, evaluation)
    }
{_test_scores(evaluation)}. Training wall time {summary.wall_time_s:.1f} s over {summary.epochs} epochs
({summary.steps} steps){_restarts(restarts, summary.steps_per_epoch)}.
{_attempts(summary)}
{_loading(selection, summary)} {_device_memory(memory, summary)}

![predicted vs measured]({links["accuracy"]})

"""

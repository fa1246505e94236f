"""Stage `report`: results/{job}/report.md and its plots, from every file the earlier stages wrote.

Plots: time vs global batch per node shape (N nodes x g GPUs; profiled points, fitted curves with their uncertainty,
both knees, the choice), the cost surface over (N x g, B), predicted vs measured step times, and the training curves.
Every file read and written is named on the command line, so the rule declares exactly what the stage touches.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from tula_hpc.core.atomic_files import read_json, write_text
from tula_hpc.core.records import FitResult, Selection, TrainSummary
from tula_hpc.core.run_layout import node_shape
from tula_hpc.performance.sync_priors import SYNC_KINDS
from tula_hpc.reporting.figures import link, markdown_table
from tula_hpc.reporting.plots import plot_cost_surface, plot_predicted_vs_measured, plot_time_vs_batch, rows_by_shape
from tula_hpc.reporting.search_section import search_section, tie_sentence
from tula_hpc.reporting.training_section import strategy_section, time_terms
from tula_hpc.stages.runner import stage_main

if TYPE_CHECKING:
    from tula_hpc.core.job import Job

INPUTS = ("memory", "plan", "perfmodel", "selection", "summary", "evaluation")
PLOTS = ("time", "cost", "accuracy", "training")
GPUS_COLUMN = [("GPUs/node", "gpus_per_node", "d")]  # "-" for a plan made before GPUs per node was a choice
RUNNER_UP_COLUMNS = [
    ("runner-up N", "nodes", "d"),
    *GPUS_COLUMN,
    ("B", "batch", "d"),
    ("T (s)", "time_s", ".2f"),
    ("cost", "cost", ".5g"),
]
# The fixed parts of the memory model (memory.json's composition), in words.
FIXED_PARTS = {
    "parameters_and_buffers": "parameters and buffers",
    "optimizer_state": "optimiser state",
    "workspace": "workspace kept (cuBLAS, cuDNN)",
    "autocast_weight_copies": "autocast's weight copies",
    "ddp_buckets": "DDP buckets",
    "nccl_ring_buffers": "NCCL ring buffers (estimated)",
    "gradients_and_temporaries": "gradients and temporaries",
}


def _deciding_figure(memory: dict) -> str:
    """Which of the allocator's figures sized the batch, the other beside it, and on CUDA the limit the trials found."""
    allocated, reserved = memory["fit"], memory["fit_reserved"]
    if reserved == allocated:
        return "The allocator reserves what it allocates here, so one figure sizes the batch."
    batch = memory["max_batch_per_device"]

    def megabytes_at_batch(fit: dict) -> float:
        return (fit["intercept_bytes"] + fit["slope_bytes_per_sample"] * batch) / 1e6

    text = (
        f"The steps' allocated bytes size the batch: {megabytes_at_batch(allocated):.1f} MB allocated at batch "
        f"{batch}, for which the caching allocator reserved {megabytes_at_batch(reserved):.1f} MB in the probes "
        f"(its slack there follows what the card has spare, not the limit)."
    )
    if memory.get("beyond_index_cap"):
        text += (
            f" Above batch {memory['index_cap']} one tensor holds 2^31 elements or more, where CUDA kernels split the"
            " batch or index in 64 bits: the trials ran there, the probes did not."
        )
    return text + _card_limit(memory["limit"]) if memory.get("limit") else text


def _card_limit(limit: dict) -> str:
    """The limit CUDA's trials bracketed: both largest batches, and what the allocator could not give back."""
    failed = f", {limit['smallest_failed']} ran out of memory" if limit["smallest_failed"] else ""
    clean = limit["without_retry"]
    text = (
        f" On the card (allocator settings '{limit['cuda_alloc_conf'] or 'the defaults'}') the largest batch that ran "
        f"is {limit['limit']}{failed}; the largest whose steps needed no allocator retry "
        + (f"is {clean}" if clean else "was not seen among the trials")
        + " (a retry frees the cache and synchronises the device: it costs time every step)."
    )
    if limit["allowance_bytes"] is not None:
        text += f" The allocator could not give back {limit['allowance_bytes'] / 1e6:.1f} MB at its limit."
    return text + " The headroom comes off the largest batch that ran."


def _fixed(memory: dict) -> str:
    """The intercept's make-up (memory.json's composition): what the device holds whatever the batch."""
    parts = memory["composition"]["fixed_bytes"]
    return ", ".join(f"{FIXED_PARTS[name]} {size / 1e6:.2f} MB" for name, size in parts.items())


def _per_sample(memory: dict) -> str:
    """The slope's make-up (memory.json's composition): what Eq. 3 counts and the temporaries it leaves out."""
    parts = memory["composition"]["per_sample_bytes"]
    return ", ".join(f"{name.replace('_', ' ')} {size / 1e3:.2f} kB" for name, size in parts.items())


def _loading(selection: Selection, summary: TrainSummary) -> str:
    """Training's wait for its loader beside the profiles' data part: the profiles synchronise every step, so
    their loading cannot overlap the device's work, while training's can (on a GPU); the gap shows how much."""
    waited = sum(r["data_wait_s"] for r in summary.history)
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


def _constraints(selection: Selection) -> str:
    set_ = {k: v for k, v in selection.constraints.items() if v is not None}
    if not set_:
        return "No constraints."
    return (
        "Constraints: "
        + ", ".join(f"{k} = {v:g}" for k, v in set_.items())
        + f" ({selection.feasible} of {selection.candidates} candidates meet them)."
    )


def _sync_terms(params: dict, identified: dict) -> str:
    """Each kind of sync's latency and time per byte, and whether the profiles fitted it or it is the job's prior."""

    def term(name: str, value: str) -> str:
        return f"{value} ({'fitted' if identified.get(name) else 'prior'})"

    return "; ".join(
        f"{kind.replace('_', '-')} "
        + term(f"{kind}_latency_s", f"{params[f'{kind}_latency_s'] * 1e6:.1f} us per hop")
        + " + "
        + term(f"{kind}_seconds_per_byte", f"{params[f'{kind}_seconds_per_byte'] * 1e9:.3f} s/GB moved")
        for kind in SYNC_KINDS
    )


def _inter_sync_levels(params: dict) -> str:
    """Host counts whose inter-node sync holds a level of its own (performance.collective_cost.inter_sync_levels);
    a perfmodel.json fitted before them holds none."""
    levels = params.get("inter_sync_levels", [])
    if not levels:
        return ""
    where = ", ".join(f"{level['over_line']:.2f} at {level['hosts']} hosts" for level in levels)
    return f"\n  inter-node part times its own level where a host count's profiles agree on one: {where}"


def _overlap(params: dict) -> str:
    """g, and what it means: the share of sync left exposed at the largest N's profiled batch extremes; and the
    interference of the all-reduce with the compute beside it, where fitted (a perfmodel.json fitted before it has
    none)."""
    shares = params["exposed_sync_share"]
    where = ", ".join(f"{s['share']:.0%} at b = {s['per_device_batch']}" for s in shares)
    interference = params.get("interference", 0.0)
    return (
        f"overlap g = {params['overlap_gamma']:.2f}"
        + (f" (exposed share of sync at N = {shares[0]['ranks']}: {where})" if shares else "")
        + (
            f"; multi-rank compute {interference:.1%} slower beside the all-reduce (interference)"
            if interference
            else ""
        )
    )


SYNC_FIT_TEXT = {
    "split": "fitted to each profile's all-reduce timed alone after a barrier (split fit)",
    "latent": "latent: fitted with g to the overlapped steps alone, as Pollux fits it (sync timed alone set aside)",
}


def _compute_kinks(params: dict) -> str:
    """The compute line's kinks, where the profiles show them (performance.kinks_predict_better)."""
    kinks = params["compute_kinks"]
    if not kinks:
        return ""
    where = ", ".join(f"{k['over_line']:.2f} at b = {k['per_device_batch']:g}" for k in kinks)
    return f"\n  times measured compute over that line at each profiled batch, interpolated (kinks): {where}"


def _model_section(plan: dict, perfmodel: FitResult) -> str:
    p, identified = perfmodel.params, perfmodel.identified
    unidentified = [name for name, ok in identified.items() if not ok]
    loo = perfmodel.leave_one_out
    quality = (
        f"leave-one-out over {loo['count']} profiles: median {loo['median_rel_error']:.1%}, "
        f"max {loo['max_rel_error']:.1%}"
        if loo["count"]
        else "no leave-one-out estimate (the profiles exactly identify the model)"
    )
    notes = "".join(f"\n- {note}" for note in perfmodel.notes)
    return f"""## Performance model ({plan["mode"]} search, {len(perfmodel.profiled)} of {
        len(plan["candidates"])
    } candidates profiled)
t_step = data + (compute^g + sync^g)^(1/g) (g = 1: sync adds to compute; larger g hides more of it behind compute),
with b the per-device batch and h the ranks per host:
- data = {p["data_intercept_s"] * 1e3:.3f} ms + {p["data_per_sample_s"] * 1e6:.2f} us x b
- compute = {p["intercept_s"] * 1e3:.3f} ms + {p["per_sample_s"] * 1e6:.2f} us x (b - {p["batch_ref"]:g}) + (h - 1) x ({
        p["contention_s"] * 1e3:.3f} ms + {p["contention_per_sample_s"] * 1e6:.2f} us x (b - {p["batch_ref"]:g})){
        _compute_kinks(p)
    }
- sync ({perfmodel.collective}) = intra-node part among a host's h ranks + inter-node part among the hosts, {
        SYNC_FIT_TEXT[p["sync_fit"]]
    }:
  {_sync_terms(p, identified)}{_inter_sync_levels(p)}
- {_overlap(p)}

Not identified by these profiles: {", ".join(unidentified) if unidentified else "none"}.{notes}
Fit error on the profiles (RMS) {p["rms_rel_error"]:.1%}; {quality}. A profiled candidate's step below counts its own
measurement with weight {
        perfmodel.measurement_weight:.2f} against the model (its out-of-sample error against the profile noise).
{search_section(perfmodel)}
{
        markdown_table(
            perfmodel.profiled,
            [
                ("N", "nodes", "d"),
                ("B", "batch", "d"),
                ("measured step (s)", "measured_step_s", ".5f"),
                ("predicted step (s)", "predicted_step_s", ".5f"),
                ("step IQR/median", "step_iqr_over_median", ".1%"),
                ("interference", "interference", ".0%"),
            ],
        )
    }"""


def _progress(selection: Selection, perfmodel: FitResult) -> str:
    """Time per recipe against time to the recipe's progress, and why they differ (the noise scale)."""
    noise, chosen = perfmodel.noise_scale, selection.chosen
    if noise is None:
        return "No gradient noise scale was measured (no multi-rank profile): every batch is timed for train.epochs."
    ran = "its progress" if selection.predicted["to"] == "progress" else "train.epochs"
    return (
        f"At the gradient noise scale the profiles measured (B_noise = {noise['b_noise']:.3g}, median of "
        f"{noise['profiles']}), this batch makes the recipe's progress (train.epochs at train.lr_base_batch) in "
        f"{chosen['progress_epochs']:.1f} epochs, {chosen['progress_time_s']:.2f} s, cost "
        f"{chosen['progress_cost']:.5g}: "
        f"a batch far above B_noise needs more epochs for the same progress, one far below it no more steps "
        f"(the dash-dotted curve). Training runs to {ran}."
    )


def _cluster(plan: dict, selection: Selection, summary: TrainSummary) -> str:
    """What the partition left out of the grid, the wait Slurm estimated for the chosen train job (objective.queue
    estimate) and the wall time it asked for."""
    predicted, parts, partition = selection.predicted, [], plan.get("partition")
    if partition and partition["excluded"]:
        reasons = sorted({reason for c in partition["excluded"] for reason in c["breaks"]})
        parts.append(
            f"Partition {partition['partition']} left out {len(partition['excluded'])} candidates: "
            f"{'; '.join(reasons)}."
        )
    if "wait_s" in predicted:
        parts.append(
            f"Queue: a wait of {predicted['wait_s']:.0f} s before the {predicted['time_s']:.1f} s of training, "
            f"{predicted['result_time_s']:.1f} s to the result; the wait is Slurm's estimate at selection time "
            f"(sbatch --test-only), not a promise."
        )
    if summary.time_limit_min is not None:
        parts.append(f"The train job asked for a wall time of {summary.time_limit_min} min.")
    return " ".join(parts)


def render(
    job: str,
    links: dict[str, str],
    memory: dict,
    plan: dict,
    perfmodel: FitResult,
    selection: Selection,
    summary: TrainSummary,
    evaluation: dict,
) -> str:
    return (
        _choice(job, links, plan, perfmodel, selection, summary)
        + _outcome(links, memory, selection, summary, evaluation)
        + _memory_model(memory, plan, perfmodel)
        + _every_candidate(perfmodel)
    )


def _choice(
    job: str, links: dict[str, str], plan: dict, perfmodel: FitResult, selection: Selection, summary: TrainSummary
) -> str:
    chosen, knees = selection.chosen, selection.knees
    return f"""# tula-hpc report: {job}

## Choice
**{node_shape(chosen)}, global batch {chosen["batch"]}** ({chosen["per_device_batch"]} per device), chosen to
minimise **{selection.objective}** ({selection.pricing} pricing). Predicted training time {chosen["time_s"]:.2f} s
(+-{chosen["rel_uncertainty"]:.0%}), cost {chosen["cost"]:.5g}. {_constraints(selection)}{tie_sentence(selection)}
{_progress(selection, perfmodel)} {_cluster(plan, selection, summary)}
Knees of the best-time-per-batch curve: Kneedle {knees["kneedle"]} (depends only on the sampled batch range),
model-based {knees["model"]} (from there each doubling saves less than {selection.knee_min_saving:.0%} of the time); the
knee objective used the {selection.knee_used or selection.knee_method} knee (asked for: `{selection.knee_method}`).

{markdown_table(selection.runners_up, RUNNER_UP_COLUMNS)}
![time vs batch]({links["time"]})

![cost surface]({links["cost"]})

"""


def _outcome(links: dict[str, str], memory: dict, selection: Selection, summary: TrainSummary, evaluation: dict) -> str:
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
Test top-1 accuracy **{evaluation["test_accuracy"]:.2%}**
on {evaluation["test_samples"]} images (BatchNorm statistics recomputed on the training set; as trained
{evaluation.get("test_accuracy_as_trained", evaluation["test_accuracy"]):.2%}). Training wall time {
        summary.wall_time_s:.1f} s over {summary.epochs} epochs
({summary.steps} steps){_restarts(restarts, summary.steps_per_epoch)}.
{_attempts(summary)}
{_loading(selection, summary)} {_device_memory(memory, summary)}

![predicted vs measured]({links["accuracy"]})

"""


def _memory_model(memory: dict, plan: dict, perfmodel: FitResult) -> str:
    return f"""## Memory model
Peak device memory of a steady step near the largest batch = {memory["fit"]["intercept_bytes"] / 1e6:.2f} MB
+ {memory["fit"]["slope_bytes_per_sample"] / 1e3:.2f} kB x batch (parameters, optimiser state and DDP buckets included;
it prices memory-based cost), of which fixed {_fixed(memory)};
per sample {_per_sample(memory)}. {_deciding_figure(memory)} Device memory {
        memory["device_memory_bytes"] / 1e9:.2f} GB ({memory["device_memory_source"]}) with {memory["headroom"]:.0%}
headroom: largest per-device batch **{memory["max_batch_per_device"]}**{
        "" if memory["verified"] else " (no trial step confirmed it)"
    }.

{
        markdown_table(
            memory["probes"],
            [
                ("probe batch", "batch", "d"),
                ("outcome", "outcome", "s"),
                ("peak allocated (B)", "peak_bytes", "d"),
                ("peak reserved (B)", "reserved_peak_bytes", "d"),
                ("saved activations (B)", "activation_bytes", "d"),
                ("autocast weight copies (B)", "autocast_weight_bytes", "d"),
                ("gradients (B)", "grad_bytes", "d"),
                ("optimiser (B)", "optimizer_bytes", "d"),
                ("workspace (B)", "workspace_bytes", "d"),
            ],
        )
    }
{_model_section(plan, perfmodel)}
"""


def _every_candidate(perfmodel: FitResult) -> str:
    candidates = [c for row in rows_by_shape(perfmodel.candidates).values() for c in row]
    return f"""### Every candidate
{
        markdown_table(
            candidates,
            [
                ("N", "nodes", "d"),
                *GPUS_COLUMN,
                ("B", "batch", "d"),
                ("b/device", "per_device_batch", "d"),
                ("step (s)", "step_s", ".5f"),
                ("+-", "rel_uncertainty", ".0%"),
                ("T (s)", "time_s", ".2f"),
                ("cost", "cost", ".5g"),
            ],
        )
    }"""


def report(job: Job, inputs: dict[str, Path], out: Path, plots: dict[str, Path]) -> None:
    """Read the files in `inputs` (keys INPUTS), write `out` and the plots in `plots` (keys PLOTS), nothing else."""
    memory, plan, evaluation = (read_json(inputs[name]) for name in ("memory", "plan", "evaluation"))
    perfmodel, selection = FitResult.read(inputs["perfmodel"]), Selection.read(inputs["selection"])
    summary = TrainSummary.read(inputs["summary"])
    plot_time_vs_batch(perfmodel, selection, plots["time"])
    plot_cost_surface(perfmodel, selection, plots["cost"])
    plot_predicted_vs_measured(perfmodel, summary, selection, plots["accuracy"])
    scaling = strategy_section(summary, plots["training"], out)
    links = {key: link(path, out) for key, path in plots.items()}
    write_text(out, render(job.name, links, memory, plan, perfmodel, selection, summary, evaluation) + scaling)


def main(argv: list[str] | None = None) -> int:
    def add_args(parser: argparse.ArgumentParser) -> None:
        for flag, dest, example in [
            ("--memory", "memory", "memory.json"),
            ("--plan", "plan", "plan.json"),
            ("--perfmodel", "perfmodel", "perfmodel.json"),
            ("--selection", "selection", "selection.json"),
            ("--summary", "summary", "train/summary.json"),
            ("--eval", "evaluation", "eval.json"),
            ("--out", "out", "report.md"),
            ("--time-plot", "time", "time_vs_batch.png"),
            ("--cost-plot", "cost", "cost_surface.png"),
            ("--accuracy-plot", "accuracy", "predicted_vs_measured.png"),
            ("--training-plot", "training", "training.png"),
        ]:
            parser.add_argument(flag, dest=dest, required=True, type=Path, help=f"results/{{job}}/{example}")

    def run(job: Job, args: argparse.Namespace) -> None:
        inputs = {name: getattr(args, name) for name in INPUTS}
        report(job, inputs, args.out, {key: getattr(args, key) for key in PLOTS})

    return stage_main("report", add_args, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())

"""Stage `report`: results/{job}/report.md and its plot, from every file the earlier stages wrote."""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from .files import atomic_path, read_json, write_text  # noqa: E402
from .stage import stage_main  # noqa: E402


def plot_time_vs_batch(perfmodel: dict, selection: dict, out: Path) -> None:
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for nodes in sorted({c["nodes"] for c in perfmodel["candidates"]}):
        row = sorted((c for c in perfmodel["candidates"] if c["nodes"] == nodes), key=lambda c: c["batch"])
        ax.plot([c["batch"] for c in row], [c["time_s"] for c in row], marker=".", label=f"predicted, N={nodes}")
        measured = [p for p in perfmodel["profiled"] if p["nodes"] == nodes]
        epochs_steps = {c["batch"]: c["steps_per_epoch"] * perfmodel["epochs"] for c in row}
        ax.scatter([p["batch"] for p in measured], [p["measured_step_s"] * epochs_steps[p["batch"]] for p in measured],
                   marker="x", s=60, label=f"profiled, N={nodes}")
    chosen = selection["chosen"]
    ax.scatter([chosen["batch"]], [chosen["time_s"]], s=200, facecolors="none", edgecolors="red", linewidths=2,
               label=f"chosen: N={chosen['nodes']}, B={chosen['batch']}")
    if selection["knees"]["kneedle"]:
        ax.axvline(selection["knees"]["kneedle"], color="grey", linestyle="--", label="Kneedle knee")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("global batch B")
    ax.set_ylabel("predicted training time T (s)")
    ax.set_title(f"{perfmodel['job']}: time vs batch ({selection['objective']} objective)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    with atomic_path(out) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)


def _table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    head = "| " + " | ".join(title for title, _, _ in columns) + " |\n|" + "---|" * len(columns) + "\n"
    return head + "".join("| " + " | ".join(format(r[key], fmt) for _, key, fmt in columns) + " |\n" for r in rows)


def render(job: str, memory: dict, plan: dict, perfmodel: dict, selection: dict, summary: dict, evaluation: dict,
           plot_name: str) -> str:
    chosen = selection["chosen"]
    candidates = sorted(perfmodel["candidates"], key=lambda c: (c["nodes"], c["batch"]))
    p = perfmodel["params"]
    resumed = summary["resumed_from_epoch"]
    return f"""# tula-hpc report: {job}

## Choice
**{chosen['nodes']} node(s), global batch {chosen['batch']}** ({chosen['per_device_batch']} per device), chosen to
minimise **{selection['objective']}**. Predicted training time {chosen['time_s']:.2f} s, cost {chosen['cost']:.5f}.
Knees of the time-vs-batch curve: Kneedle {selection['knees']['kneedle']}, model-based {selection['knees']['model']}.

![time vs batch]({plot_name})

## Outcome
| | predicted | measured |
|---|---|---|
| training time (s, steps only) | {evaluation['predicted_train_time_s']:.2f} | {evaluation['measured_train_time_s']:.2f} |
| cost | {evaluation['predicted_cost']:.5f} | {evaluation['measured_cost']:.5f} |

Relative time error {evaluation['time_rel_error']:+.1%}. Test top-1 accuracy **{evaluation['test_accuracy']:.2%}**
on {evaluation['test_samples']} images. Training wall time {summary['wall_time_s']:.1f} s over {summary['epochs']} epochs
({summary['steps']} steps){'' if resumed is None else f'; resumed from the checkpoint at epoch {resumed}'}.

## Memory model
Peak step memory = {memory['fit']['intercept_bytes'] / 1e6:.2f} MB + {memory['fit']['slope_bytes_per_sample'] / 1e3:.2f} kB x batch,
plus {memory['param_bytes'] / 1e6:.2f} MB of parameters. Device memory {memory['device_memory_bytes'] / 1e9:.2f} GB with
{memory['headroom']:.0%} headroom: largest per-device batch **{memory['max_batch_per_device']}**.

{_table(memory['probes'], [('probe batch', 'batch', 'd'), ('measured peak (B)', 'measured_peak_bytes', 'd'),
                           ('activations (B)', 'activation_bytes', 'd'), ('gradients (B)', 'grad_bytes', 'd'),
                           ('optimiser (B)', 'optimizer_bytes', 'd')])}
## Performance model ({plan['mode']} search, {len(perfmodel['profiled'])} of {len(plan['candidates'])} candidates profiled)
t_step = {p['local_intercept_s_'] * 1e3:.3f} ms + {p['local_per_sample_s_'] * 1e6:.2f} us x b + (1 - {p['overlap_']:.2f}) x sync(N),
sync latency {p['latency_s_'] * 1e3:.3f} ms per hop, {p['seconds_per_byte_'] * 1e9:.3f} s/GB; fit error (RMS) {p['rel_uncertainty_']:.1%}.

{_table(perfmodel['profiled'], [('N', 'nodes', 'd'), ('B', 'batch', 'd'), ('measured step (s)', 'measured_step_s', '.5f'),
                                ('predicted step (s)', 'predicted_step_s', '.5f')])}
### Every candidate
{_table(candidates, [('N', 'nodes', 'd'), ('B', 'batch', 'd'), ('b/device', 'per_device_batch', 'd'),
                     ('step (s)', 'step_s', '.5f'), ('T (s)', 'time_s', '.2f'), ('cost', 'cost', '.5f')])}"""


def report(job: dict, results_dir: Path, out: Path) -> None:
    results_dir = Path(results_dir)
    inputs = {name: read_json(results_dir / f) for name, f in [
        ("memory", "memory.json"), ("plan", "plan.json"), ("perfmodel", "perfmodel.json"),
        ("selection", "selection.json"), ("summary", "train/summary.json"), ("evaluation", "eval.json")]}
    plot = Path(out).with_name("time_vs_batch.png")
    plot_time_vs_batch(inputs["perfmodel"], inputs["selection"], plot)
    write_text(out, render(job["name"], **inputs, plot_name=plot.name))


def main(argv: list[str] | None = None) -> int:
    def add_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--results-dir", required=True, type=Path, help="results/{job}")
        parser.add_argument("--out", required=True, type=Path, help="results/{job}/report.md")

    return stage_main("report", add_args, lambda job, args: report(job, args.results_dir, args.out), argv)


if __name__ == "__main__":
    raise SystemExit(main())

"""Benchmark: the probe stage's largest batch on recorded GPU runs, replayed against the truth seen on the card.

Why: the memory model's figures on the CPU come from an allocator that is exact; a GPU's caching allocator is not,
and GPUs are lent rarely. Every GPU run records its cases in bench/data/gpu/ (one JSON each: the job, the stage's
probes as memory.json holds them, every trial with its outcome, peaks and allocator events, and the truth: the
largest batch seen to fit and the smallest seen to fail, with how they were found; README there). This replays each
case through the stage's own code, no second implementation:
- fit: memory_model.fit_probes on the recorded probes (the allocated-peak model that decides, and the reserved one
  for comparison), room as memory_model.room_for_steps gives it at headroom 0;
- trials: memory_model.next_bracket_trial chooses each batch as the stage would, and the truth answers it: fits at
  or below the largest batch seen to fit, out of memory at or above the smallest seen to fail; a batch between them
  (or above the largest seen to fit where nothing failed) is unknown and answered out of memory, the cautious
  answer, and counted (`unknown_trials`). Allocator events come from a recorded trial at the same batch, else are
  unknown (and such a trial never counts as free of retries);
- choice: memory_model.cuda_choice at headroom 0, the training-set cap left out (the truth is the card's).
Figures per case: the choice's error against the truth, (chosen - largest seen to fit) / largest seen to fit; a
choice above the largest seen to fit is `above_truth` (at or above a failed batch: a failure wherever it occurs);
the model-only lines' errors (the allocated line with no allowance, the reserved line the stage used before), the
trials it took, and the allowance it measured. The summary names the case furthest from the truth, signed.
Targets: largest_batch_rel_error between -3 % and 0; no case above the truth.

Run:  .venv/bin/python bench/memory_replay.py            (seconds; writes bench/results/memory_replay.json)
"""

from __future__ import annotations

from pathlib import Path

from tula_bench.common import GPU_CASES, bench_job, bench_parser, merged, provenance, read_case
from tula_hpc.core.atomic_files import write_json
from tula_hpc.core.job import Job
from tula_hpc.memory.model import (
    cuda_choice,
    ddp_bucket_bytes,
    fit_probes,
    measured,
    next_bracket_trial,
    room_for_steps,
)

CASES = GPU_CASES
NO_CAP = 2**40  # the replay leaves the training set's cap out: the truth is the card's limit
TARGET = {"low": -0.03, "high": 0.0}


def answer(batch: int, case: dict) -> dict:
    """What the card did (or would have done) at `batch`, as a trial record."""
    truth, recorded = case["truth"], {t["batch"]: t for t in case["trials"]}
    fits_up_to, fails_from = truth["largest_fits"] or 0, truth["smallest_fails"]
    known = batch <= fits_up_to or (fails_from is not None and batch >= fails_from)
    events = recorded.get(batch, {}).get("allocator_events", {"num_alloc_retries": None})
    return {
        "batch": batch,
        "outcome": "fits" if batch <= fits_up_to else "out_of_memory",
        "known": known,
        "allocator_events": events,
    }


def replay_case(name: str, case: dict) -> dict:
    # Settings added since the case was recorded take today's defaults.
    job = Job.from_dict(merged(bench_job().as_dict(), case["job"])).updated(resources={"memory_headroom": 0.0})
    probes, budget = case["memory"]["probes"], case["memory"]["device_memory_bytes"]
    ran = measured(probes)
    model, reserved = fit_probes(ran), fit_probes(ran, "reserved")
    room = room_for_steps(job, budget, probes, headroom=False) - ddp_bucket_bytes(job, ran)
    trials: list[dict] = []
    while (batch := next_bracket_trial(model, room, trials, NO_CAP)) is not None:
        trials.append(answer(batch, case))
    choice = cuda_choice(model, trials, room, budget, 0.0, NO_CAP)
    truth = case["truth"]["largest_fits"]
    fails = case["truth"]["smallest_fails"]

    def error(batch: int) -> float:
        return (batch - truth) / truth

    return {
        "case": name,
        "device": case["recorded"]["device"].get("name") if isinstance(case["recorded"]["device"], dict) else None,
        "allocator_conf": case.get("allocator_conf", ""),
        "truth": case["truth"],
        "chosen": choice["chosen"],
        "rel_error": error(choice["chosen"]),
        "above_truth": choice["chosen"] > truth,
        "at_or_above_a_failure": fails is not None and choice["chosen"] >= fails,
        "allocated_line": model.max_batch(room),
        "allocated_line_rel_error": error(model.max_batch(room)),
        "reserved_line": reserved.max_batch(room),
        "reserved_line_rel_error": error(reserved.max_batch(room)),
        "allowance_bytes": choice["allowance_bytes"],
        "allowance_share_of_room": None if choice["allowance_bytes"] is None else choice["allowance_bytes"] / room,
        "trials": [t["batch"] for t in trials],
        "unknown_trials": sum(not t["known"] for t in trials),
        "without_retry": choice["without_retry"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, "memory_replay.json")
    parser.add_argument("--cases", type=Path, default=CASES, help="folder of case files (default %(default)s)")
    args = parser.parse_args(argv)
    cases = sorted(args.cases.glob("*.json"))
    rows = [replay_case(path.stem, read_case(path, "memory", ("job", "memory", "truth"))) for path in cases]
    worst = max(rows, key=lambda r: abs(r["rel_error"]))
    summary = {
        "largest_batch_rel_error": worst["rel_error"],
        "above_truth_cases": [r["case"] for r in rows if r["above_truth"]],
        "cases": len(rows),
    }
    judged = {
        "worst_case": worst["case"],
        "met": all(TARGET["low"] <= r["rel_error"] <= TARGET["high"] for r in rows),
        "target": TARGET,
    }
    # The summary first, as the issue names it; then the verdict, where it came from and every case.
    settings = {"cases_folder": str(args.cases)}
    document = {"summary": summary, "judged": judged, "provenance": provenance(), "settings": settings, "rows": rows}
    write_json(args.out, document)
    print(f"wrote {args.out}", flush=True)
    for r in rows:
        print(
            f"{r['case']:48s} chosen {r['chosen']:>6} truth {r['truth']['largest_fits']:>6} ({r['rel_error']:+.2%}); "
            f"allocated line {r['allocated_line_rel_error']:+.2%}, reserved line {r['reserved_line_rel_error']:+.2%};"
            f" {len(r['trials'])} trials ({r['unknown_trials']} unknown)"
        )
    print(
        f"largest_batch_rel_error {summary['largest_batch_rel_error']:+.2%} ({judged['worst_case']}); "
        f"above the truth: {summary['above_truth_cases'] or 'none'}; target {TARGET['low']:+.0%}..{TARGET['high']:+.0%}"
        f": {'met' if judged['met'] else 'NOT MET'}"
    )
    return 0

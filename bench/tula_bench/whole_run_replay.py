"""Benchmark: whole training runs recorded on GPUs, predicted again by today's code.

Why: what a run spends beside its steps (tula_hpc.performance.run_overhead: the warm-up W, the epoch ends) meets a
GPU only when one is lent. So every GPU run that trains keeps its runs in bench/data/gpu/whole_run/ (bench/whole_run.py
--gpu, the GPU check's steptime section; fields in bench/data/gpu/README.md): the job, each run's profile as the
profile stage's worker wrote it, and the train stage's clock (train_time_s, metrics.jsonl's epoch_time_s). This
predicts each run again from its profile through the fit-model stage's own code (whole_run.predicted), no second
implementation, and scores it as bench/whole_run.py does, one record (one machine, one session) at a time: each
figure's median error over the (profile, run) pairs of a configuration, and where a record repeats a configuration,
its noise floor (a run against its repeats).

Targets, per record: the whole run within whole_run.WHOLE_RUN_TARGET x its noise floor (where there is one); the first
epoch within 25 % and the steady epochs (the last) within 10 % of the prediction (issue 40's GPU targets). The summary
names the record furthest from each.

Run:  .venv/bin/python bench/whole_run_replay.py            (seconds; writes bench/results/whole_run_replay.json)
"""

from __future__ import annotations

import copy
from pathlib import Path

from tula_bench.common import bench_job, bench_parser, merged, provenance, read_case, verdict, write_and_report
from tula_bench.whole_run import CASES, WHOLE_RUN_TARGET, analyse
from tula_hpc.core.job import Job

EPOCH_TARGETS = {"first_epoch": 0.25, "steady_epoch": 0.10}


def read_record(path: Path) -> dict:
    return read_case(path, "whole-run", ("job", "train_samples", "runs"))


def replay_record(name: str, record: dict) -> dict:
    """One record's runs predicted by today's code, with its figures and verdicts."""
    # Settings added since the record take today's defaults; none of them changes what a run measured.
    job = Job.from_dict(merged(bench_job().as_dict(), record["job"]))
    runs = copy.deepcopy(record["runs"])
    models = {run["model"] for run in runs}
    analysis = analyse(runs, dict.fromkeys(models, job), dict.fromkeys(models, record["train_samples"]))
    figures = analysis["figures"]
    verdicts = {"whole_run_over_noise_floor": analysis["target"]} if figures["whole_run"]["noise_floor"] else {}
    verdicts |= {f"{f}_median": verdict(figures[f]["median_rel_error"], t) for f, t in EPOCH_TARGETS.items()}
    return {
        "record": name,
        "device": (record.get("recorded") or record.get("provenance") or {}).get("device"),
        "runs": len(runs),
        "figures": figures,
        "verdicts": verdicts,
        "predicted": [
            {key: run[key] for key in ("model", "nodes", "per_device_batch", "repeat", "epoch_time_s", "predicted")}
            for run in analysis["runs"]
        ],
    }


def summarise(rows: list[dict]) -> dict:
    """Each verdict's worst record, and whether every record meets every target it is judged on."""
    judged = sorted({name for row in rows for name in row["verdicts"]})
    worst = {}
    for name in judged:
        row = max((r for r in rows if name in r["verdicts"]), key=lambda r: r["verdicts"][name]["figure"])
        worst[name] = {"record": row["record"], **row["verdicts"][name]}
    all_met = all(v["met"] for row in rows for v in row["verdicts"].values())
    return {"records": len(rows), "worst": worst, "all_met": all_met}


def report(result: dict) -> None:
    for row in result["rows"]:
        f = row["figures"]
        floor = f["whole_run"]["over_noise_floor"]
        print(
            f"{row['record']:44s} {row['runs']} runs: whole run {f['whole_run']['median_rel_error']:.1%}"
            f"{'' if floor is None else f' ({floor:.2f}x its noise floor)'}, first epoch "
            f"{f['first_epoch']['median_rel_error']:.1%}, steady {f['steady_epoch']['median_rel_error']:.1%}"
        )
    for name, worst in result["summary"]["worst"].items():
        shown = f"{worst['figure']:.2f}x" if name.endswith("noise_floor") else f"{worst['figure']:.1%}"
        print(
            f"{name:28s} {'met' if worst['met'] else 'NOT met'}: worst {shown} ({worst['record']}; target "
            f"{worst['target']})"
        )


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, "whole_run_replay.json")
    parser.add_argument("--cases", type=Path, default=CASES, help="folder of whole-run cases (default %(default)s)")
    args = parser.parse_args(argv)
    rows = [replay_record(path.stem, read_record(path)) for path in sorted(args.cases.glob("*.json"))]
    if not rows:
        raise SystemExit(f"{args.cases}: no whole-run case (*.json) to replay")
    targets = {"whole_run_over_noise_floor": WHOLE_RUN_TARGET, **EPOCH_TARGETS}
    settings = {"cases_folder": str(args.cases), "targets": targets}
    result = {"summary": summarise(rows), "provenance": provenance(), "settings": settings, "rows": rows}
    return write_and_report(args.out, result, report)

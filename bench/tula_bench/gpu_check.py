"""GPU check: the figures only a GPU gives, measured with the workflow's own code, in one file (`make gpu-check`).

Sections (bench/gpu_memory.py, bench/gpu_steps.py), run in order of value (bench/gpu_plan.py: VALUE), each a function
of the device, the size preset (gpu_plan.PRESETS), a scratch folder and the run's context, returning its figures and
its targets as met or not, with the figure. The workloads: CIFAR-10's shape (3 x 32 x 32) with resnet18, ImageNet's
(224 px) with resnet50 in bf16 and channels_last and with torchvision's vit_b_16 in bf16, on the synthetic data set.
- memory (CIFAR's shape) and memory_imagenet (ImageNet's): for each case, in one process, the truth of the largest
  batch (bench/gpu_truth.py: the stage's probes, then a bisection with real steady steps until a fitting and a
  failing batch lie within 1 %); where PyTorch Lightning is importable, its BatchSizeFinder on the same model
  (bench/gpu_lightning.py: its trials, answer and seconds); the probe stage itself (`memory_worker.probe_worker` +
  `memory_summary.summarise`) timed in one process (the CIFAR case; in fresh processes too at the quick scale, as the
  H200 did once at 3ca5bc3, 0.64 % apart); each memory figure's model against the
  bisection's fitting trials. Every case goes to bench/data/gpu/ as a replay case (<device>-<date>-<case>.json,
  never over an existing file).
- oom: the train stage (`train.train`) under a budget (resources.device_memory_gb) checked in-process to fail its
  batch and fit half of it; the first attempt must end in a real out-of-memory error and the relaunch finish with the
  global batch unchanged.
- steptime: profiles at N = 1 over each workload's batch axis by the profile stage's own measurement in shuffled
  rounds (noise floor, leave-one-out error of the performance model), then the train stage's worker at a profiled
  batch for epochs of at least 200 steps: its epochs from the third (metrics.jsonl's epoch_time_s) against the epoch
  the fit-model stage's computation predicts. Each trained run, with its profile, goes to bench/data/gpu/whole_run/
  as a whole-run case (<device>-<date>-<case>.json) that bench/whole_run_replay.py predicts again.
- dag: config/jobs.yaml's job on one GPU at N = 1 (`device_memory_gb: auto`) through `snakemake --profile
  profiles/local` in a scratch folder: wall time, each stage's wall time (from Snakemake's log), chosen configuration,
  accuracy. Completion is judged by Snakemake's exit and the outputs; its timeout only stops work still running.

Before it starts, the check prints its plan: each section's estimate, from seconds recorded on a real run scaled by
the preset's size (gpu_plan.FIGURES). With --budget-s a section whose estimate does not fit what is left is skipped,
saying so; `--plan` prints the plan alone (`make gpu-dry-run` prints the default preset's).

The result file accumulates: each run rewrites only the sections it runs and keeps the others, so a check split
over several device calls (`--sections memory`, then `--sections steptime`, ...) ends in one file. Each section is
written as it ends and stamped with the device's name, torch's version, the git commit and the digest of the code
(SOURCES) it was measured with, and the scale. A kept section whose device, torch, code digest or scale differs from
this run's is kept, marked `stale` with what differs, and judges nothing (it leaves `verdicts`, and `complete` and
`all_met` are false) until it is run again. (The commit is stamped, not compared: the GPU machine's copy has no
.git, and the digest names the code there.) `seconds` records each section's and the whole run's; run through
scripts/gpu-python.sh (`make gpu-check` on the GPU machine), the whole run's include the call's setup before Python
started the check (installing the wheels: `run.setup_s`), which the slot and --budget-s hold too.

On a GPU the allocator runs as a job's processes run it (PYTORCH_CUDA_ALLOC_CONF, unless set, is the jobs' default
resources.cuda_alloc_conf), recorded with the device.

On a lent machine only the device call's return folder comes back: `--copy-to "$OUT"` copies the result and the
cases this run added there after every section (each kind in its folder, as under bench/data/gpu/), so a call cut
short at its limit still returns every section it finished.

Without a GPU (and --device auto) it says so, measures nothing, writes nothing and exits 0. `--device cpu
--scale quick --out PATH` runs every section on the CPU at tiny sizes: a test of this check's own code, never
written to bench/results/gpu_check.json nor to bench/data/gpu/.

Run:  make gpu-check   (the GPU machine has no .venv: scripts/gpu-python.sh, python3 with the wheels of
      `make gpu-wheels`; `make gpu-dry-run` rehearses that here), e.g. GPU_CHECK_ARGS="--budget-s 280"
      .venv/bin/python bench/gpu_check.py --device cpu --scale quick --out /tmp/gpu_check.json
Writes bench/results/gpu_check.json.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import sys
import time
import traceback
from pathlib import Path

from tula_bench import gpu_memory, gpu_plan, gpu_steps
from tula_bench.common import GPU_CASES, WORK, bench_job, bench_parser, verdict
from tula_bench.gpu_device import device_info, provenance_here
from tula_hpc.core.atomic_files import write_json

SECTIONS = {  # in order of value (gpu_plan.VALUE)
    "memory": gpu_memory.memory_section,
    "oom": gpu_memory.oom_section,
    "memory_imagenet": functools.partial(gpu_memory.memory_section, key="memory_imagenet"),
    "steptime": gpu_steps.steptime_section,
    "dag": gpu_steps.dag_section,
}
TARGETS = {**gpu_memory.TARGETS, **gpu_steps.TARGETS, "check_s": gpu_plan.SLOT_S}
CALL_STARTED_ENV = "TULA_GPU_CALL_STARTED"  # scripts/gpu-python.sh's start, Unix seconds
# A kept section measured with any of these different from this run is stale.
STALE_IF = ("device", "torch", "source_digest", "scale")
PRESETS = gpu_plan.PRESETS


def all_verdicts(sections: dict) -> dict:
    """Every section's verdicts, as 'section.target'."""
    return {f"{name}.{key}": v for name, s in sections.items() for key, v in s.get("verdicts", {}).items()}


# --- the result file ----------------------------------------------------------------------------------


def section_stamp(info: dict, found: dict, scale: str) -> dict:
    """What a section's figures were measured with."""
    return {
        "device": info["name"],
        "torch": info["torch"],
        "git_commit": found["git_commit"],
        "source_digest": found["source_digest"],
        "scale": scale,
    }


def earlier_sections(path: Path, stamp: dict) -> dict:
    """The sections earlier runs left in `path`, each marked `stale` with what differs from `stamp` (STALE_IF)
    where anything does; sections this code no longer has are dropped."""
    try:
        earlier = json.loads(path.read_text()).get("sections", {})
    except (OSError, ValueError):
        return {}
    kept = {}
    for name, section in earlier.items():
        if name not in SECTIONS:
            continue
        then = section.get("stamp", {})
        differs = {key: {"then": then.get(key), "now": stamp[key]} for key in STALE_IF if then.get(key) != stamp[key]}
        kept[name] = {key: value for key, value in section.items() if key != "stale"}
        if differs:
            kept[name]["stale"] = differs
            print(f"{path}: section {name} was measured with other {', '.join(differs)}: kept, marked stale")
    return kept


def result_document(sections: dict, info: dict, found: dict, scale: str, run: dict) -> dict:
    """The result file: this run's provenance and settings, then every section, verdicts from the fresh ones, and
    the seconds of each section and of the whole run (`run`: its plan, what it skipped, the sections finished and its
    seconds so far)."""
    ordered = {name: sections[name] for name in SECTIONS if name in sections}
    fresh = {name: s for name, s in ordered.items() if "stale" not in s}
    verdicts = all_verdicts(fresh)
    whole = set(run["plan"]) == set(run["finished"]) == set(SECTIONS) and not run["skipped"]
    if scale == "gpu" and whole:  # the whole default preset ran to its end (not yet while a section is to come)
        verdicts["check.within_slot"] = verdict(run["seconds"], TARGETS["check_s"])
    complete = set(fresh) == set(SECTIONS)
    return {
        "provenance": found,
        "device": info,
        "settings": {"scale": scale, "preset": PRESETS[scale], "targets": TARGETS, "stale_if": STALE_IF},
        "targets_judged": info["type"] == "cuda" and scale == "gpu",
        "verdicts": verdicts,
        "complete": complete,
        "missing_or_stale": [name for name in SECTIONS if name not in fresh],
        "all_met": complete and all(v["met"] for v in verdicts.values()),
        "seconds": {**{name: s.get("section_seconds") for name, s in ordered.items()}, "run": run["seconds"]},
        "run": run,
        "sections": ordered,
    }


def run_section(name: str, device: str, preset: dict, scratch: Path, context: dict) -> dict:
    started = time.perf_counter()
    print(f"== {name}", flush=True)
    try:
        result = SECTIONS[name](device, preset, scratch, context)
    except Exception:
        result = {"error": traceback.format_exc()[-6000:], "verdicts": {"ran": {"met": False}}}
        print(result["error"], file=sys.stderr, flush=True)
    result["section_seconds"] = time.perf_counter() - started
    print(f"== {name}: {result['section_seconds']:.0f} s", flush=True)
    result["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    result["stamp"] = context["stamp"]
    return result


def report(verdicts: dict) -> None:
    for name, v in verdicts.items():
        figure, target = v.get("figure"), v.get("target")
        shown = ""
        if isinstance(figure, float):
            shown = f" {figure:.2%} (target {target:.0%})" if target < 1 else f" {figure:.0f} s (target {target:.0f} s)"
        print(f"{name:40s} {'met' if v['met'] else 'NOT MET'}{shown}", flush=True)


def copy_back(result: Path, cases_dir: Path, before: set[Path], dest: Path) -> list[str]:
    """The result file and the cases this run added (those not in `before`) into `dest`, each kind in its folder as
    under bench/data/gpu/: a device call's return folder, the only one that comes back. Each file is copied whole (a
    copy, then a rename), after every section, so that a call cut short still returns what it finished."""
    copied = []
    for path in [result, *sorted(set(cases_dir.rglob("*.json")) - before)]:
        relative = Path(result.name) if path == result else path.relative_to(cases_dir)
        target = dest / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f".{target.name}.partial")
        shutil.copyfile(path, partial)
        os.replace(partial, target)
        copied.append(relative.as_posix())
    return copied


def call_setup_seconds() -> float | None:
    """Seconds since scripts/gpu-python.sh started (installing the wheels, starting Python, importing torch), which
    the slot holds too; None where it did not start this run."""
    started = os.environ.get(CALL_STARTED_ENV)
    return None if not started else max(0.0, time.time() - float(started))


def run_sections(args, device: str, scale: str, out: Path) -> tuple[dict, dict]:
    """The sections asked for, in order of value, each written as it ends; one whose estimate does not fit what is
    left of --budget-s is skipped, saying so. The result document and this run's sections."""
    info, found = device_info(device), provenance_here()
    stamp = section_stamp(info, found, scale)
    recorded = {"device": info, "git_commit": found["git_commit"], "source_digest": found["source_digest"]}  # a case's
    sections = earlier_sections(out, stamp)
    scratch = args.work_dir / time.strftime("%Y%m%d-%H%M%S")
    cases_dir = GPU_CASES if device == "cuda" else scratch / "cases"
    cases_dir.mkdir(parents=True, exist_ok=True)
    before = set(cases_dir.rglob("*.json"))
    print(
        f"gpu-check on {info['name']} ({device}, torch {info['torch']}), scale {scale}; scratch {scratch}", flush=True
    )
    rows = gpu_plan.plan(PRESETS[scale], device, args.sections, args.budget_s)
    print(gpu_plan.plan_text(rows, device, args.budget_s), flush=True)
    setup_s = call_setup_seconds()
    started = time.monotonic() - (setup_s or 0.0)  # the slot counts the call's setup too
    end = started + (args.budget_s if args.budget_s is not None else 24 * 3600)
    plan = {r["section"]: r["estimate_s"] for r in rows}
    run = {"plan": plan, "budget_s": args.budget_s, "setup_s": setup_s, "skipped": {}, "finished": []}
    ran, document = {}, None
    for row in rows:
        name, elapsed = row["section"], time.monotonic() - started
        if args.budget_s is not None and elapsed + row["estimate_s"] > args.budget_s:
            run["skipped"][name] = gpu_plan.skip_reason(name, row["estimate_s"], elapsed, args.budget_s)
            print(f"== {name}: {run['skipped'][name]}", flush=True)
        else:
            context = {"stamp": stamp, "recorded": recorded, "cases_dir": cases_dir, "deadline": end}
            sections[name] = ran[name] = run_section(name, device, PRESETS[scale], scratch, context)
            run["finished"].append(name)
        run["seconds"] = time.monotonic() - started
        document = result_document(sections, info, found, scale, run)
        write_json(out, document)  # after each section: a call cut short keeps what it measured
        if args.copy_to is not None:
            print(f"copied to {args.copy_to}: {', '.join(copy_back(out, cases_dir, before, args.copy_to))}", flush=True)
    return document, ran


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, "gpu_check.json")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: the GPU if any")
    parser.add_argument("--scale", choices=sorted(PRESETS), help="sizes (default: gpu on CUDA, quick on the CPU)")
    parser.add_argument("--sections", nargs="+", choices=list(SECTIONS), default=list(SECTIONS), help="to run")
    parser.add_argument("--work-dir", type=Path, default=WORK / "gpu_check", help="scratch (default %(default)s)")
    parser.add_argument("--budget-s", type=float, help="skip, saying so, the sections that would not fit this slot")
    parser.add_argument("--plan", action="store_true", help="print the plan with each section's estimate, run nothing")
    parser.add_argument(
        "--copy-to", type=Path, help="after each section, copy the result and the cases added into this folder ($OUT)"
    )
    args = parser.parse_args(argv)
    if args.plan:  # needs no GPU: the estimates are recorded figures
        scale = args.scale or ("quick" if args.device == "cpu" else "gpu")
        device = "cpu" if scale == "quick" else "cuda"
        print(
            gpu_plan.plan_text(
                gpu_plan.plan(PRESETS[scale], device, args.sections, args.budget_s), device, args.budget_s
            )
        )
        return 0

    import torch

    if args.device == "auto" and not torch.cuda.is_available():
        print(
            f"gpu-check: no CUDA GPU found (torch {torch.__version__}: torch.cuda.is_available() is False); "
            f"nothing was measured and {args.out} was not written."
        )
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device cuda: torch {torch.__version__} sees no CUDA GPU")
    device = "cuda" if args.device == "auto" else args.device
    if device == "cpu" and args.out.resolve() == parser.get_default("out").resolve():
        parser.error(f"--device cpu tests the check itself: name its file with --out (never {args.out})")
    if device == "cuda":  # before the allocator starts: the truths, Lightning and the stage under the jobs' setting
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", bench_job().resources.cuda_alloc_conf or "")
        if os.environ["PYTORCH_CUDA_ALLOC_CONF"]:  # torch is imported already: set them in it too, as launch does
            torch.cuda.memory._set_allocator_settings(os.environ["PYTORCH_CUDA_ALLOC_CONF"])
    document, ran = run_sections(args, device, args.scale or ("gpu" if device == "cuda" else "quick"), args.out)
    print(f"wrote {args.out}", flush=True)
    report(document["verdicts"])
    if not document["complete"]:
        print(f"not complete: {', '.join(document['missing_or_stale'])} missing or stale", flush=True)
    return 1 if any("error" in s for s in ran.values()) else 0

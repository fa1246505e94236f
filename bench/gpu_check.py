"""GPU check: the figures only a GPU gives, measured with the workflow's own code, in one file (`make gpu-check`).

Sections (bench/gpu_memory.py, bench/gpu_steps.py), each a function of the device and a size preset (PRESETS)
returning its figures and its targets as met or not, with the figure:
- memory: for each model, image size and precision (fp32, bf16), the probe stage's own probes and fit, then real
  steady steps (`memory_probes.run_in_fresh_process("trial")`) at batches from twice the largest probe up to the largest
  batch the model gives for the card (and no tensor of 2^31 elements, `index_cap`): relative error of the predicted
  peak, median and max, against the allocator's peaks (max_memory_allocated) and reserved peaks
  (max_memory_reserved, what sizes the batch).
- training: the memory stage itself (`memory.probe_memory`: probes, fit, verification trials with their correction)
  proposes the largest batch; the train stage's worker (`train.train_worker`, at N = 1 as the stage runs it) trains
  it for real, and 5 % above it: whether each ran or ran out of memory, and the run's peak against the predicted
  one. Where the training set, not memory, caps the proposal (digits on a whole card), the stage runs again under a
  budget that puts the model's largest batch at half the training set.
- oom: the train stage (`train.train`) under a budget between the measured peaks of its batch and of half of it, so
  the first attempt runs out of memory for real; the relaunch must finish with the global batch unchanged.
- steptime: profiles at N = 1 over the whole batch axis by the profile stage's own measurement in shuffled rounds
  (as bench/perf_accuracy.py: noise floor, leave-one-out error of the performance model), then the train stage
  (`train.train_worker`) at a profiled batch: its measured epochs (metrics.jsonl's epoch_time_s) against the epoch
  the perfmodel stage's computation (`perfmodel.fit_and_predict`) predicts from one round of profiles.
- dag: config/jobs.yaml's job on one GPU at N = 1, the batch sized from the card (`device_memory_gb: auto`),
  through `snakemake --profile profiles/local` in a scratch folder: wall time, chosen configuration, accuracy.

The result file accumulates: each run rewrites only the sections it runs and keeps the others, so a check split
over several device calls (`--sections memory`, then `--sections steptime`, ...) ends in one file. Each section is
stamped with the device's name, torch's version, the git commit and the digest of the code (SOURCES) it was measured
with, and the scale. A kept section whose device, torch, code digest or scale differs from this run's is kept, marked
`stale` with what differs, and judges nothing (it leaves `verdicts`, and `complete` and `all_met` are false) until
it is run again: its figures still say what the other code did, which a split check must not silently lose, but
not what this code does. (The commit is stamped, not compared: the GPU machine's copy has no .git, and the digest
names the code there.)

Without a GPU (and --device auto) it says so, measures nothing, writes nothing and exits 0. `--device cpu
--scale quick --out PATH` runs every section on the CPU at tiny sizes: a test of this check's own code, never
written to bench/results/gpu_check.json.

Run:  make gpu-check   (the GPU machine has no .venv: scripts/gpu-python.sh, python3 with the wheels of
      `make gpu-wheels`; `make gpu-dry-run` rehearses that here)
      .venv/bin/python bench/gpu_check.py --device cpu --scale quick --out /tmp/gpu_check.json
Writes bench/results/gpu_check.json.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import gpu_memory
import gpu_steps
from common import WORK, bench_parser, files_digest, provenance

from tula_hpc.files import write_json

SECTIONS = {
    "memory": gpu_memory.memory_section,
    "training": gpu_memory.training_section,
    "oom": gpu_memory.oom_section,
    "steptime": gpu_steps.steptime_section,
    "dag": gpu_steps.dag_section,
}
TARGETS = {**gpu_memory.TARGETS, **gpu_steps.TARGETS}
# A kept section measured with any of these different from this run is stale.
STALE_IF = ("device", "torch", "source_digest", "scale")
# Sizes. gpu: what the targets are judged on (digits resized to CIFAR's 32x32; the default job's 8x8 for step
# times). quick: every section at tiny sizes, about a minute on two CPU cores.
PRESETS = {
    "gpu": {
        "memory": {
            "cases": [{"model": "tiny_cnn", "image_size": 32}, {"model": "resnet18", "image_size": 32}],
            "precisions": ["fp32", "bf16"],
            "device_memory_gb": "auto",  # the card's own memory
            "batches": 5,
        },
        "training": {
            "cases": [
                {"model": "tiny_cnn", "image_size": 32, "precision": "fp32"},
                {"model": "resnet18", "image_size": 32, "precision": "bf16"},
            ],
            "device_memory_gb": "auto",
            "epochs": 1,
        },
        "oom": {"model": "tiny_cnn", "image_size": 32, "batch": 512, "epochs": 2},
        "steptime": {
            "cases": [{"model": "tiny_cnn", "image_size": 8}, {"model": "resnet18", "image_size": 32}],
            "batch": {"min": 16, "max": 1024},
            "rounds": 3,
            "measurement": {},  # the job's own (config/jobs.yaml)
            "epochs_trained": 3,
        },
        "dag": {"changes": {}, "timeout_s": 3000},
    },
    "quick": {
        "memory": {
            "cases": [{"model": "tiny_cnn", "image_size": 8}],
            "precisions": ["fp32"],
            "device_memory_gb": 0.1,
            "batches": 3,
        },
        "training": {
            "cases": [{"model": "tiny_cnn", "image_size": 8, "precision": "fp32"}],
            "device_memory_gb": 0.1,
            "epochs": 1,
        },
        "oom": {"model": "tiny_cnn", "image_size": 8, "batch": 512, "epochs": 2},
        "steptime": {
            "cases": [{"model": "tiny_cnn", "image_size": 8}],
            "batch": {"min": 16, "max": 64},
            "rounds": 2,
            "measurement": {"warmup_steps": 1, "steps": 2, "min_measure_s": 0.05, "max_attempts": 1},
            "epochs_trained": 2,
        },
        "dag": {
            "changes": {
                "train": {"epochs": 2, "lr_milestones": []},
                "search": {
                    "batch": {"min": 64, "max": 128},
                    "warmup_steps": 1,
                    "steps": 2,
                    "min_measure_s": 0.05,
                    "max_attempts": 1,
                },
            },
            "timeout_s": 900,
        },
    },
}
# Source folders and files whose bytes identify the code that measured (the GPU machine's copy has no .git).
SOURCES = ("tula_hpc", "bench", "workflow", "config", "profiles", "Snakefile")


def all_verdicts(sections: dict) -> dict:
    """Every section's verdicts, as 'section.target'."""
    return {f"{name}.{key}": v for name, s in sections.items() for key, v in s.get("verdicts", {}).items()}


# --- the result file ----------------------------------------------------------------------------------


def provenance_here() -> dict:
    """common.provenance: the commit TULA_GIT_COMMIT names where the caller sets it (the GPU machine's copy has no
    .git), else git's; where git finds no .git above the tree either, the same with no commit. The source digest
    identifies the code either way."""
    try:
        found = provenance()
    except (OSError, subprocess.CalledProcessError):
        import platform
        from importlib.metadata import version

        import common

        found = {
            "git_commit": None,
            "git_dirty": None,
            "processor": common._processor(),
            "cpus": len(os.sched_getaffinity(0)),
            "python": platform.python_version(),
            "torch": version("torch"),
            "written_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
    return {**found, "source_digest": files_digest(list(SOURCES))}


def device_info(device: str) -> dict:
    import torch

    info = {"type": device, "torch": torch.__version__, "cuda": torch.version.cuda}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(
            name=torch.cuda.get_device_name(0), memory_bytes=props.total_memory, cudnn=torch.backends.cudnn.version()
        )
    else:
        import common

        info["name"] = common._processor()
    return info


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


def result_document(sections: dict, info: dict, found: dict, scale: str) -> dict:
    """The result file: this run's provenance and settings, then every section, verdicts from the fresh ones."""
    ordered = {name: sections[name] for name in SECTIONS if name in sections}
    fresh = {name: s for name, s in ordered.items() if "stale" not in s}
    verdicts = all_verdicts(fresh)
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
        "sections": ordered,
    }


def run_section(name: str, device: str, preset: dict, scratch: Path, stamp: dict) -> dict:
    started = time.perf_counter()
    print(f"== {name}", flush=True)
    try:
        result = SECTIONS[name](device, preset, scratch)
    except Exception:
        result = {"error": traceback.format_exc()[-6000:], "verdicts": {"ran": {"met": False}}}
        print(result["error"], file=sys.stderr, flush=True)
    result["section_seconds"] = time.perf_counter() - started
    print(f"== {name}: {result['section_seconds']:.0f} s", flush=True)
    result["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    result["stamp"] = stamp
    return result


def report(verdicts: dict) -> None:
    for name, v in verdicts.items():
        figure = v.get("figure")
        shown = f" {figure:.2%} (target {v['target']:.0%})" if isinstance(figure, float) else ""
        print(f"{name:40s} {'met' if v['met'] else 'NOT MET'}{shown}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, "gpu_check.json")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: the GPU if any")
    parser.add_argument("--scale", choices=sorted(PRESETS), help="sizes (default: gpu on CUDA, quick on the CPU)")
    parser.add_argument("--sections", nargs="+", choices=list(SECTIONS), default=list(SECTIONS), help="to run")
    parser.add_argument("--work-dir", type=Path, default=WORK / "gpu_check", help="scratch (default %(default)s)")
    args = parser.parse_args(argv)

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
    scale = args.scale or ("gpu" if device == "cuda" else "quick")
    info, found = device_info(device), provenance_here()
    stamp = section_stamp(info, found, scale)
    sections = earlier_sections(args.out, stamp)
    scratch = args.work_dir / time.strftime("%Y%m%d-%H%M%S")
    print(
        f"gpu-check on {info['name']} ({device}, torch {info['torch']}), scale {scale}; scratch {scratch}", flush=True
    )
    ran = {}
    for name in args.sections:
        sections[name] = ran[name] = run_section(name, device, PRESETS[scale], scratch, stamp)
        document = result_document(sections, info, found, scale)
        write_json(args.out, document)  # after each section: a call cut short keeps what it measured
    print(f"wrote {args.out}", flush=True)
    report(document["verdicts"])
    if not document["complete"]:
        print(f"not complete: {', '.join(document['missing_or_stale'])} missing or stale", flush=True)
    return 1 if any("error" in s for s in ran.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())

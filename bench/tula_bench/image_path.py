"""Benchmark: the image path is unchanged by a change of the code: seeded weights after training, bit for bit, between
this checkout and an earlier commit (default: main before issue 57, whose task contract, AdamW and run length
rewired every step), for the strategies whose arithmetic the change touched most (ags, lrs, adascale), each with
its batch in one slice and in three (gradient accumulation).

Each side trains the default job (digits, tiny CNN) in a fresh process with that checkout first on its path,
through the train stage's own worker (`train_worker`, whose signature both sides share), and prints the sha256 of
every tensor of the trained model in order. The earlier code is a `git worktree` of the commit, removed after.

Run:  .venv/bin/python bench/image_path.py [--base COMMIT]   (writes bench/results/image_path.json; about 2 min)
      .venv/bin/python bench/image_path.py --smoke --out FILE   (one case, one epoch)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tula_bench.common import REPO, bench_parser, parse_bench_args, provenance, write_and_report

BASE = "4286ac3"  # main before issue 57
CASES = [("ags", 1), ("ags", 3), ("lrs", 1), ("lrs", 3), ("adascale", 1)]
EPOCHS = 3
# What each side runs, with its checkout first on sys.path: the default job trained, its weights' digest printed.
TRAIN_AND_DIGEST = """
import hashlib, json, sys, tempfile, torch, yaml
from pathlib import Path
from tula_hpc.config import job_settings, validate_config
from tula_hpc.training.trainer import train_worker
strategy, accumulation, epochs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
config = yaml.safe_load(Path("config/jobs.yaml").read_text())
job = config["jobs"]["digits-cnn"]
job["train"].update(strategy=strategy, epochs=epochs, warmup_epochs=1, lr_milestones=[epochs])
job = job_settings(validate_config(config), "digits-cnn")
folder = Path(tempfile.mkdtemp())
paths = {name: str(folder / name) for name in ("checkpoint.pt", "model.pt", "metrics.jsonl")}
train_worker(job, 256, paths["checkpoint.pt"], paths["model.pt"], paths["metrics.jsonl"], accumulation=accumulation)
weights = torch.load(paths["model.pt"], weights_only=False)["model"]
digest = hashlib.sha256()
for name, tensor in weights.items():
    digest.update(name.encode() + tensor.cpu().contiguous().numpy().tobytes())
print(json.dumps({"digest": digest.hexdigest()}))
"""


def trained_digest(checkout: Path, strategy: str, accumulation: int, epochs: int) -> str:
    env = {**os.environ, "PYTHONPATH": str(checkout), "OMP_NUM_THREADS": "1"}
    args = [sys.executable, "-c", TRAIN_AND_DIGEST, strategy, str(accumulation), str(epochs)]
    done = subprocess.run(args, cwd=checkout, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"training under {checkout} failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])["digest"]


def compare(base: str, cases: list[tuple[str, int]], epochs: int) -> list[dict]:
    """Each case's digest on both sides, the earlier code in a worktree of `base` made and removed here."""
    earlier = Path(tempfile.mkdtemp(prefix="image-path-")) / "base"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(earlier), base], check=True)
    try:
        rows = []
        for strategy, accumulation in cases:
            before = trained_digest(earlier, strategy, accumulation, epochs)
            after = trained_digest(REPO, strategy, accumulation, epochs)
            rows.append({"strategy": strategy, "accumulation": accumulation, "base": before, "head": after})
            print(f"{strategy:9s} {accumulation} slice(s): {'identical' if before == after else 'DIFFERENT'}")
        return rows
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(earlier)], check=True)


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, "image_path.json")
    parser.add_argument("--base", default=BASE, help="the earlier commit (default %(default)s)")
    parser.add_argument("--smoke", action="store_true", help="one case, one epoch")
    args = parse_bench_args(parser, argv)
    cases, epochs = (CASES[:1], 1) if args.smoke else (CASES, EPOCHS)
    rows = compare(args.base, cases, epochs)
    identical = sum(row["base"] == row["head"] for row in rows)
    result = {
        "provenance": provenance(),
        "settings": {"base": args.base, "cases": cases, "epochs": epochs, "job": "digits-cnn", "global_batch": 256},
        "cases": rows,
        "verdict": {"met": identical == len(rows), "figure": identical, "target": len(rows)},
    }
    return write_and_report(
        args.out, result, lambda r: print(f"{identical} of {len(rows)} cases bit-identical to {args.base}")
    )

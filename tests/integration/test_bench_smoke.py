"""Every bench script run as its command line on its smallest case, its result written to a temporary place (the
one mechanism: `--out`) and read back, so that a bench cannot break unseen. A script without a smoke case yet is
named in NO_SMOKE_CASE_YET with the reason; the last test holds every script to one of the two lists."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

BENCH = Path(__file__).resolve().parents[2] / "bench"
# script -> its smallest case's arguments (besides --out) and whether it writes a result (gpu_check without a GPU
# says so and writes nothing).
SMOKE = {
    "memory_replay": ([], True),
    "whole_run_replay": ([], True),
    "statistical_efficiency": ([], True),
    "goodput_replay": ([], True),
    "gpu_plan_of_gpu_check": (["--plan"], False),
    "gpu_check": ([], False),
    "trace_accuracy": (["--smoke"], True),
    "trace_tuning": (["--smoke"], True),
    "steady_truth": (["--smoke"], True),
    "memory_accuracy": (["--smoke"], True),
    "max_batch_search": (["--smoke"], True),
    "gpu_truth": (["--smoke"], True),
    "ags_overhead": (["--smoke"], True),
    "generalization": (["--smoke"], True),
    "generalization_fmnist": (["--smoke"], True),
    "loader_pace": (["--smoke"], True),
    "perf_accuracy": (["--smoke"], True),
    "whole_run": (["--smoke"], True),
    "adaptive_fmnist": (["--smoke"], True),
    "lm_large_batch": (["--smoke"], True),
}
SCRIPT = {"gpu_plan_of_gpu_check": "gpu_check"}
# Slurm benches: tests/slurm/test_bench_smoke_slurm.py, test_chaos_bench.py and test_sites.py (they need the
# cluster). A script added without a smallest-case option goes in NO_SMOKE_CASE_YET with the reason, until it has one.
NEEDS_SLURM = {"chaos", "chaos_sites", "queue_wait", "slurm_overhead"}
NO_SMOKE_CASE_YET: dict[str, str] = {
    "shakespeare_gpt": "each seed runs the example's whole DAG (up to 10 minutes); tests/unit/test_shakespeare_gpt.py "
    "checks its reading of the runs' files and its verdicts on fake ones",
    "image_path": "each side trains in a process of its own, the earlier one in a git worktree of another commit "
    "(about 2 minutes); its comparison is bit for bit, with no figure to degrade unseen",
}


@pytest.mark.parametrize("case", sorted(SMOKE))
def test_the_bench_runs_its_smallest_case_and_its_result_reads_back(case, tmp_path):
    arguments, writes = SMOKE[case]
    out = tmp_path / f"{case}.json"
    script = BENCH / f"{SCRIPT.get(case, case)}.py"
    cmd = [sys.executable, str(script), *arguments, "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert out.exists() == writes, proc.stdout[-2000:]
    if writes:
        result = json.loads(out.read_text())
        assert result["provenance"]["git_commit"], result.get("provenance")


def test_every_bench_script_has_a_smoke_case_or_a_stated_reason():
    scripts = {path.stem for path in BENCH.glob("*.py")}
    covered = {SCRIPT.get(case, case) for case in SMOKE} | NEEDS_SLURM | set(NO_SMOKE_CASE_YET)
    assert scripts == covered, scripts ^ covered

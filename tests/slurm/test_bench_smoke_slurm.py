"""The Slurm benches in their smoke mode (--smoke): each run as its command line against the local cluster, its result
written under tmp_path (--out) and read back. chaos.py's short variant is tests/slurm/test_chaos_bench.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO
from tula_hpc.core.atomic_files import read_json

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


@pytest.mark.parametrize("script", ["queue_wait", "slurm_overhead"])
def test_the_slurm_bench_runs_and_its_result_reads_back(script, slurm_cluster, tmp_path):
    out = tmp_path / f"{script}.json"
    command = [sys.executable, str(REPO / "bench" / f"{script}.py"), "--smoke", "--out", str(out)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = read_json(out)
    assert result["provenance"]["git_commit"] and result["settings"]["smoke"]

"""The short variant of bench/chaos.py that CI runs (the full 40 trials take longer than CI may): two of the seed's
trials on the digits job, a node taken down mid-job and a checkpoint corrupted between runs, each survived by running
the same command again, with the figures the full bench must reach."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO
from tula_hpc.core.atomic_files import read_json

SHORT_TRIALS = [3, 6]  # of seed 28's draws: digits node_down, digits corrupt_checkpoint


def test_a_node_down_and_a_corrupted_checkpoint_are_survived_by_running_the_same_command_again(slurm_cluster, tmp_path):
    out = tmp_path / "chaos.json"
    command = [sys.executable, str(REPO / "bench" / "chaos.py"), "--only", *map(str, SHORT_TRIALS)]
    proc = subprocess.run(
        [*command, "--reference-runs", "1", "--out", str(out)], capture_output=True, text=True, timeout=1800
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = read_json(out)
    assert [(t["job"], t["fault"]) for t in result["trials"]] == [
        ("digits", "node_down"),
        ("digits", "corrupt_checkpoint"),
    ]
    assert result["details"]["faults_landed"] == 2
    assert result["details"]["slurm_cycles_clean"] == 2  # make slurm-down left no daemon, slurm-up worked at once
    summary = result["summary"]
    assert summary["completed"] == 2 and summary["manual_steps"] == 0
    assert summary["bad_files_accepted"] == 0
    assert summary["steps_repeated_beyond_one"] == 0
    assert summary["bit_equal_share"] in (1.0, None)  # None: no trial resumed with the undisturbed run's choice

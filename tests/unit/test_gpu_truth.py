"""bench/gpu_truth.py's command line: a smoke run is the quick case on the CPU, written to --out alone; a GPU run
writes its case files where --out-dir says."""

from __future__ import annotations

import pytest
from tula_bench import gpu_truth


def test_a_smoke_run_is_the_quick_case_on_the_cpu(tmp_path):
    args = gpu_truth.parse_arguments(["--smoke", "--out", str(tmp_path / "truth.json")])
    assert (args.device, args.scale, args.out_dir) == ("cpu", "quick", None)


@pytest.mark.parametrize("argv", [["--smoke"], ["--smoke", "--out", "x.json", "--out-dir", "cases"], []])
def test_a_smoke_run_adds_no_case_file_and_a_run_without_smoke_names_its_folder(argv, capsys):
    """--smoke never writes bench/data/gpu (--out alone); any other run needs --out-dir, as before."""
    with pytest.raises(SystemExit):
        gpu_truth.parse_arguments(argv)
    assert "--out" in capsys.readouterr().err


def test_a_gpu_run_keeps_its_command_line(tmp_path):
    args = gpu_truth.parse_arguments(["--out-dir", str(tmp_path)])
    assert (args.device, args.scale, args.out, args.smoke) == ("cuda", "gpu", None, False)

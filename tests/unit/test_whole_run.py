"""bench/whole_run.py: --smoke is the CPU case's smallest run; a --gpu run (which records a case) cannot be one."""

from __future__ import annotations

import pytest
from tula_bench import whole_run


def test_smoke_and_gpu_together_are_refused_before_anything_runs():
    with pytest.raises(SystemExit) as stopped:
        whole_run.main(["--smoke", "--gpu"])
    assert stopped.value.code == 2


def test_the_smoke_case_is_within_the_full_one():
    assert set(whole_run.SMOKE_MODELS) <= set(whole_run.MODELS)
    assert all(nodes == 1 for nodes, _ in whole_run.SMOKE_CONFIGS)

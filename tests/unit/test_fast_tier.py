"""The fast tier's guard, on planted tests run by pytester in this process (so nothing here starts a process)."""

from __future__ import annotations

import pytest

PLANTED = """
import os
import subprocess

import pytest


def test_runs_a_command():
    subprocess.run(["true"], check=True)


def test_swallows_the_refusal():
    try:
        subprocess.run(["true"], check=True)
    except Exception:
        pass


def test_forks():
    if os.fork() == 0:
        os._exit(0)


@pytest.mark.spawns
def test_marked():
    pass


def test_plain():
    assert 1 + 1 == 2
"""


@pytest.fixture
def planted(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeconftest('pytest_plugins = ["tests.fast_tier"]')
    pytester.makepyfile(test_planted=PLANTED)
    return pytester


def test_a_fast_tier_test_that_starts_a_process_fails_naming_the_marker(planted):
    result = planted.runpytest("--fast", "-k", "runs_a_command or forks")
    result.assert_outcomes(failed=2, deselected=3)
    result.stdout.fnmatch_lines(["*test_runs_a_command started a process (subprocess.Popen)*pytest.mark.spawns*"])
    result.stdout.fnmatch_lines(["*test_forks started a process (os.fork)*"])


def test_a_test_that_swallows_the_refusal_fails_all_the_same(planted):
    result = planted.runpytest("--fast", "-k", "swallows")
    result.assert_outcomes(failed=1, deselected=4)
    result.stdout.fnmatch_lines(["*test_swallows_the_refusal started a process*"])


def test_the_fast_tier_leaves_out_marked_tests_and_runs_the_rest(planted):
    result = planted.runpytest("--fast", "-k", "marked or plain")
    result.assert_outcomes(passed=1, deselected=4)


def test_without_the_option_every_test_is_collected_and_nothing_is_guarded(planted):
    result = planted.runpytest("--collect-only", "-q")
    result.stdout.fnmatch_lines(["5 tests collected*"])
    result = planted.runpytest("-k", "marked or plain")
    result.assert_outcomes(passed=2, deselected=3)


def test_the_integration_and_slurm_folders_mark_their_tests(pytester: pytest.Pytester):
    """The folder gives the marker, so that `-m integration` and `--fast` select by it."""
    pytester.makeconftest('pytest_plugins = ["tests.fast_tier"]')
    for folder in ("unit", "integration", "slurm"):
        pytester.mkpydir(folder)
        pytester.path.joinpath(folder, f"test_{folder}_planted.py").write_text("def test_it():\n    pass\n")
    result = pytester.runpytest("--fast", "-q")
    result.assert_outcomes(passed=1, deselected=2)
    result = pytester.runpytest("-q", "-m", "integration or slurm")
    result.assert_outcomes(passed=2, deselected=1)

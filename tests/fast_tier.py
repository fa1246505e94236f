"""The fast tier (`pytest --fast`, `make test-fast`): the unit tests that start no process and no DAG, for working.

A test is left out of it by a marker (`spawns`, `slow`, `integration`, `slurm`; the last two are given by the folder).
In the fast tier a test that starts a process anyway fails, naming the marker to add: unmarked, it would slowly make
the tier what it is meant not to be. The guard stops the process before it starts, and fails the test even where the
code under test swallows the error (a fallback on OSError, say). A DAG is a process too: Snakemake runs as a command.
"""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess

import pytest

LEFT_OUT = ("spawns", "slow", "integration", "slurm")
FOLDER_MARKERS = {"integration": "integration", "slurm": "slurm"}  # tests/<folder>/test_*.py -> their marker

# Where a process starts: subprocess (and so asyncio, os.popen, submitit's local executor, a snakemake command),
# fork and spawn (multiprocessing's Process under every start method, and so torch's mp.spawn and a DataLoader's
# workers, and process pools).
ENTRY_POINTS = (
    (subprocess.Popen, "__init__", "subprocess.Popen"),
    (multiprocessing.process.BaseProcess, "start", "multiprocessing's Process.start"),
    (os, "fork", "os.fork"),
    (os, "forkpty", "os.forkpty"),
    (os, "posix_spawn", "os.posix_spawn"),
    (os, "posix_spawnp", "os.posix_spawnp"),
    (os, "system", "os.system"),
)
STARTED = pytest.StashKey[list]()


class ProcessInFastTier(RuntimeError):
    """Raised where a fast-tier test starts a process."""


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--fast",
        action="store_true",
        help=f"the fast tier: leave out tests marked {', '.join(LEFT_OUT)}; fail a test that starts a process",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "spawns: starts a process (a subprocess, fork or spawn); not in the fast tier")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.parent.name in FOLDER_MARKERS:
            item.add_marker(FOLDER_MARKERS[item.path.parent.name])
    if not config.getoption("fast"):
        return
    kept = [item for item in items if not any(item.get_closest_marker(name) for name in LEFT_OUT)]
    config.hook.pytest_deselected(items=[item for item in items if item not in kept])
    items[:] = kept


def _refusing(item: pytest.Item, what: str):
    def refuse(*args, **kwargs):
        message = (
            f"{item.nodeid} started a process ({what}) in the fast tier: mark the test @pytest.mark.spawns "
            "(or its module `pytestmark = pytest.mark.spawns`) so that `make test-fast` leaves it out"
        )
        item.stash[STARTED].append(message)
        raise ProcessInFastTier(message)

    return refuse


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    """Setup, call and teardown run with every process entry point refusing, in the fast tier."""
    if not item.config.getoption("fast"):
        return (yield)
    item.stash[STARTED] = []
    with pytest.MonkeyPatch.context() as patch:
        for owner, name, what in ENTRY_POINTS:
            if hasattr(owner, name):
                patch.setattr(owner, name, _refusing(item, what))
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A test that started a process fails, whatever became of the error it was given."""
    report = yield
    started = item.stash.get(STARTED, [])
    if started and report.failed:  # the refusal became another error: say where it came from
        report.sections.append(("fast tier", "\n".join(started)))
    elif started:
        report.outcome = "failed"
        report.longrepr = "\n".join(started)
    started.clear()  # told once, by this phase's report
    return report

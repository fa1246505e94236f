"""scripts/slurm/down.sh and the session fixture stop what they should, and only that.

These tests stop and restart the shared local cluster; each leaves it running, as the session found it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO
from tests.slurm.conftest import SCRIPTS, STATE


def _script(name: str, **env: str) -> None:
    proc = subprocess.run(["bash", SCRIPTS / name], env={**os.environ, **env}, capture_output=True, text=True)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"


def _alive(pid: int) -> bool:
    """Some thread of `pid` still runs (a process that has fully exited but is not reaped yet does not)."""
    try:
        stats = [(task / "stat").read_text() for task in Path(f"/proc/{pid}/task").iterdir()]
    except OSError:
        return False
    return any(stat.rsplit(")", 1)[-1].split()[0] not in ("Z", "X") for stat in stats)


def _daemon_pids() -> dict[str, int]:
    return {f.stem: int(f.read_text()) for f in (STATE / "pids").glob("*.pid")}


def _ours() -> list[int]:
    """Live processes that carry the marker every daemon of this checkout's cluster has in its environment."""
    marker = f"TULA_SLURM_STATE={STATE}".encode()
    found = []
    for proc in Path("/proc").iterdir():
        try:
            environ = (proc / "environ").read_bytes() if proc.name.isdigit() else b""
        except OSError:
            continue
        if marker in environ.split(b"\0") and _alive(int(proc.name)):
            found.append(int(proc.name))
    return found


def test_the_cluster_answers(slurm_cluster):
    """Also the whole of the nested sessions below."""
    assert subprocess.run(["sinfo", "-h", "-o", "%D"], capture_output=True, text=True, check=True).stdout.strip()


def test_down_returns_only_when_every_daemon_is_gone(slurm_cluster):
    """Daemons started from a CI-sized environment (/proc/PID/environ over a page) were left running by down.sh."""
    _script("down.sh")
    try:
        _script("up.sh", TULA_TEST_PADDING="x" * 65536)
        pids = _daemon_pids()
        assert len(pids) >= 6, pids
        _script("down.sh")
        assert [name for name, pid in pids.items() if _alive(pid)] == []
        assert _ours() == []
    finally:
        _script("up.sh")


def _nested_session() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"{__file__}::test_the_cluster_answers"],
        cwd=REPO,
        env={**os.environ, "CI": "true"},
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_a_session_stops_the_cluster_it_started_and_leaves_alone_one_it_found(slurm_cluster):
    _script("down.sh")
    try:
        _nested_session()
        assert _ours() == [], "the session left daemons of the cluster it started running"
    finally:
        _script("up.sh")
    found = _daemon_pids()
    _nested_session()
    assert _daemon_pids() == found and all(_alive(pid) for pid in found.values())

"""Files on a cluster's shared file system, written on one node and read on another: a bounded wait for them to
appear (NFS caches a folder's attributes, so a finished job's file may show late), and a lock that needs no
`flock` (Lustre mounted without it refuses fcntl.flock)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

FILE_SYSTEM_LAG_S = 30  # how long a file may take to show, where resources.slurm.file_system_lag_s does not say
FILE_POLL_S = 0.5
LOCK_POLL_S = 0.2
LOCK_STALE_S = 900  # a lock of another host older than this is broken: its holder died (it holds a lock seconds)


def appeared(folder: Path, present: Callable[[], bool], within_s: float) -> bool:
    """Whether `present()` holds, looking again for up to `within_s`: each look lists `folder` and its parent
    first, which refreshes NFS's attribute cache of them (submitit refreshes it before it reads results)."""
    deadline = time.monotonic() + within_s
    while True:
        for seen in (Path(folder), Path(folder).parent):
            with contextlib.suppress(OSError):
                os.listdir(seen)
        if present():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(FILE_POLL_S)


def _holder() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "time": time.time()}


def _stale(path: Path) -> bool:
    """A lock whose holder is known dead (a pid of this host that no longer runs) or older than LOCK_STALE_S."""
    try:
        holder = json.loads(path.read_text())
        age = time.time() - holder["time"]
    except FileNotFoundError:
        return False
    except (OSError, ValueError, KeyError, TypeError):  # being written, or cut short by a crash: judged by its age
        try:
            return time.time() - path.stat().st_mtime > LOCK_STALE_S
        except FileNotFoundError:
            return False
    if holder.get("host") == socket.gethostname():
        try:
            os.kill(int(holder["pid"]), 0)
        except ProcessLookupError:
            return True
        except (PermissionError, ValueError, KeyError):
            pass
    return age > LOCK_STALE_S


@contextlib.contextmanager
def exclusive_lock(path: Path) -> Iterator[None]:
    """Hold `path` as a lock: created with O_CREAT|O_EXCL, atomic on NFS and Lustre whether or not they lock,
    holding its holder's host, pid and time, so that a stale one is broken; removed on the way out."""
    path = Path(path)
    while True:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            if _stale(path):
                path.unlink(missing_ok=True)
                print(f"[tula-hpc] broke the stale lock {path}", flush=True)
            else:
                time.sleep(LOCK_POLL_S)
            continue
        with os.fdopen(fd, "w") as held:
            json.dump(_holder(), held)
        break
    try:
        yield
    finally:
        path.unlink(missing_ok=True)

"""`tula-hpc <stage> ...`: one console script for every stage, plus workflow housekeeping."""

from __future__ import annotations

import importlib
import socket
import sys
from pathlib import Path

STAGES = {
    "probe-memory": "tula_hpc.stages.probe_memory",
    "plan": "tula_hpc.stages.plan",
    "profile": "tula_hpc.stages.profile",
    "adapt": "tula_hpc.stages.adapt",
    "fit-model": "tula_hpc.stages.fit_model",
    "select": "tula_hpc.stages.select",
    "train": "tula_hpc.stages.train",
    "evaluate": "tula_hpc.stages.evaluate",
    "report": "tula_hpc.stages.report",
}


DRIVER_RECORD = Path(".snakemake") / "tula-driver.json"


def record_driver(workdir: Path = Path(".")) -> None:
    """Snakemake's onstart (the folder is locked by then, dry runs never get here): which host and process hold the
    lock, for the next run to tell a stale lock from a live one."""
    import psutil

    from tula_hpc.core.atomic_files import write_json

    me = psutil.Process()
    write_json(workdir / DRIVER_RECORD, {"host": socket.gethostname(), "pid": me.pid, "created": me.create_time()})


def remove_stale_lock(workdir: Path = Path(".")) -> bool:
    """The Snakefile's top level, before Snakemake locks the folder: a lock whose recorded driver ran on this host
    and is gone (SIGKILLed, out of memory, its session closed) is removed, so that the same command resumes the run.
    A lock of a live driver, of another host (a shared file system) or of no record is kept: Snakemake then says
    so, and `tula-hpc unlock-stale` remains."""
    import psutil

    from tula_hpc.core.atomic_files import read_json

    locks, record_path = workdir / ".snakemake" / "locks", workdir / DRIVER_RECORD
    if not locks.is_dir() or not any(locks.iterdir()) or not record_path.exists():
        return False
    driver = read_json(record_path)
    if driver["host"] != socket.gethostname():
        return False
    try:
        if abs(psutil.Process(driver["pid"]).create_time() - driver["created"]) < 1:
            return False  # alive
    except psutil.NoSuchProcess:
        pass
    _remove_locks(locks)
    print(f"removed the lock of a driver that is gone (pid {driver['pid']} on {driver['host']})", file=sys.stderr)
    return True


def unlock_stale(workdir: Path = Path(".")) -> int:
    """Remove Snakemake's lock if no Snakemake process is running here (a SIGKILLed driver leaves one)."""
    import psutil

    locks = workdir / ".snakemake" / "locks"
    if not locks.is_dir() or not any(locks.iterdir()):
        return 0
    here = workdir.resolve()
    for proc in psutil.process_iter(["cmdline", "cwd"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if "snakemake" in cmdline and proc.info["cwd"] and Path(proc.info["cwd"]).resolve() == here:
            print(f"snakemake (pid {proc.pid}) is running in {here}: lock kept", file=sys.stderr)
            return 0
    _remove_locks(locks)
    print(f"removed the stale Snakemake lock in {here} (no Snakemake process was running)", file=sys.stderr)
    return 0


def _remove_locks(locks: Path) -> None:
    for lock in locks.iterdir():
        lock.unlink()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(
            "usage: tula-hpc {" + ",".join([*STAGES, "unlock-stale"]) + "} [options]\n"
            "Each stage takes --config config/jobs.yaml --job NAME; see tula-hpc STAGE --help."
        )
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "profile" and "--adaptive" in rest:
        # The adapt stage before it had a command of its own: the adapt rule still calls it so, since Snakemake
        # reruns a rule whose command changed and the results made before must stay done.
        command, rest = "adapt", [arg for arg in rest if arg != "--adaptive"]
    if command == "unlock-stale":
        return unlock_stale()
    if command not in STAGES:
        print(
            f"tula-hpc: unknown command '{command}'; allowed: {', '.join([*STAGES, 'unlock-stale'])}", file=sys.stderr
        )
        return 2
    return importlib.import_module(STAGES[command]).main(rest)


if __name__ == "__main__":
    raise SystemExit(main())

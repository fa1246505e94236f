"""`tula-hpc <stage> ...`: one console script for every stage, plus workflow housekeeping."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

STAGES = {
    "probe-memory": "tula_hpc.memory",
    "plan": "tula_hpc.plan",
    "profile": "tula_hpc.profiling",
    "fit-model": "tula_hpc.perfmodel",
    "select": "tula_hpc.selection",
    "train": "tula_hpc.train",
    "evaluate": "tula_hpc.evaluate",
    "report": "tula_hpc.report",
}


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
    for lock in locks.iterdir():
        lock.unlink()
    print(f"removed the stale Snakemake lock in {here} (no Snakemake process was running)", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(
            "usage: tula-hpc {" + ",".join([*STAGES, "unlock-stale"]) + "} [options]\n"
            "Each stage takes --config config/jobs.yaml --job NAME; see tula-hpc STAGE --help."
        )
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
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

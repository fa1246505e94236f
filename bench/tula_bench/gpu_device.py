"""The GPU machine's facts for a GPU result file: the device, and the code that measured where the copy has no .git
(shared by the GPU check and the truth it runs)."""

from __future__ import annotations

import os
import subprocess
import time

from tula_bench.common import REPO, files_digest, processor, provenance

# Source folders and files whose bytes identify the code that measured (the GPU machine's copy has no .git): bench's
# code, not bench/data, where a GPU run writes its cases (a second call after the first's cases were committed would
# otherwise find the first call's sections stale).
SOURCES = ("tula_hpc", "bench/*.py", "bench/tula_bench/*.py", "workflow", "config", "profiles", "Snakefile")


def source_digest() -> str:
    """files_digest of SOURCES, a pattern standing for the files it matches (a plain path must exist)."""
    paths = [
        path.relative_to(REPO).as_posix() for source in SOURCES if "*" in source for path in sorted(REPO.glob(source))
    ]
    return files_digest([source for source in SOURCES if "*" not in source] + paths)


def provenance_here() -> dict:
    """common.provenance: the commit TULA_GIT_COMMIT names where the caller sets it (the GPU machine's copy has no
    .git), else git's; where git finds no .git above the tree either, the same with no commit. The source digest
    identifies the code either way."""
    try:
        found = provenance()
    except (OSError, subprocess.CalledProcessError):
        import platform
        from importlib.metadata import version

        found = {
            "git_commit": None,
            "git_dirty": None,
            "processor": processor(),
            "cpus": len(os.sched_getaffinity(0)),
            "python": platform.python_version(),
            "torch": version("torch"),
            "written_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
    return {**found, "source_digest": source_digest()}


def device_info(device: str) -> dict:
    import torch

    info = {"type": device, "torch": torch.__version__, "cuda": torch.version.cuda}
    info["cuda_alloc_conf"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(
            name=torch.cuda.get_device_name(0), memory_bytes=props.total_memory, cudnn=torch.backends.cudnn.version()
        )
    else:
        info["name"] = processor()
    return info

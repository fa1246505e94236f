"""What running on GPUs rather than CPUs implies for a rank, decided here: whether this host's CUDA gives each rank a
GPU of its own, and which process-group backend serves its tensors (what sync costs where the profiles cannot tell
is the performance model's: performance/sync_priors.py).

Also what an error that says a device ran out of memory looks like (`is_out_of_memory`). torch is imported only
inside the functions that ask CUDA or look at an error: config validation imports this module for every
job, and only a GPU job on the local launcher (or a GPU rank) asks.
"""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path

NVIDIA_DRIVER_VERSION = Path("/proc/driver/nvidia/version")  # written by the NVIDIA kernel module when loaded


class DeviceError(RuntimeError):
    """A GPU job cannot have a GPU of its own for each rank here; the message says what this host's CUDA is."""


def backend_for(device) -> str:
    """A process group that serves every tensor a rank hands it: NCCL for the GPU's, gloo for the CPU's.

    Not NCCL alone on GPUs: small bookkeeping collectives (profiling's interference, object gathers) hold CPU
    tensors, which a NCCL-only group has no backend for.
    """
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def join_one_rank_group(device) -> None:
    """A process group of this process alone, as a rank on `device` has one: what DDP's buckets and NCCL's
    communicator need to exist in a probe that runs without peers."""
    import torch.distributed as dist

    dist.init_process_group(backend_for(device), store=dist.HashStore(), rank=0, world_size=1)


def driver_version() -> str:
    """The NVIDIA kernel driver's version, read where the driver states it."""
    try:
        text = NVIDIA_DRIVER_VERSION.read_text()
    except OSError:
        return "not found"
    found = re.search(r"Kernel Module\s+(?:for \S+\s+)?(\d[\w.]*)", text)
    return found.group(1) if found else text.strip().splitlines()[0]


def cuda_setup() -> str:
    """What decides whether torch's CUDA works on this host (a driver older than the wheel's CUDA, devices
    hidden by CUDA_VISIBLE_DEVICES), for an error to name."""
    import torch

    wheel = f"CUDA {torch.version.cuda}" if torch.version.cuda else "no CUDA (a CPU-only build)"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return (
        f"host {socket.gethostname()}: torch {torch.__version__} built for {wheel}, NVIDIA driver "
        f"{driver_version()}, CUDA_VISIBLE_DEVICES={'unset' if visible is None else repr(visible)}"
    )


def usable_gpus() -> int:
    """GPUs this process can use: none when CUDA is unusable here."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def bound_one_gpu_per_task(visible: int) -> bool:
    """Slurm bound this rank one GPU of its own (--gpus-per-task=1: resources.slurm.gpu_binding task), which it
    sees alone, as device 0, whatever its local rank. Told from what the rank sees: Slurm's per-task request in its
    environment (a typed one reads "a100:1") and the one GPU visible."""
    per_task = os.environ.get("SLURM_GPUS_PER_TASK", "").rpartition(":")[2]
    return visible == 1 and per_task == "1"


def rank_gpu(local_rank: int) -> int:
    """The GPU of a rank: its node's `local_rank`-th, or its own where Slurm bound it one. Never the CPU in its
    stead (a GPU job's profiles and training would silently measure something else), nor a GPU another rank holds
    (NCCL refuses two ranks on one GPU)."""
    gpus = usable_gpus()
    if not gpus:
        raise DeviceError(
            f"this GPU job's rank {local_rank} finds CUDA unusable ({cuda_setup()}); a driver older than the "
            f"wheel's CUDA or a CUDA_VISIBLE_DEVICES that names no GPU does this: update the driver, install a "
            f"torch wheel built for the driver's CUDA, or name the GPUs"
        )
    if bound_one_gpu_per_task(gpus):
        return 0
    if local_rank >= gpus:
        raise DeviceError(
            f"local rank {local_rank} has no GPU of its own: {gpus} GPU(s) visible ({cuda_setup()}); "
            f"a node runs at most one rank per GPU"
        )
    return local_rank


# What a RuntimeError says when an allocation failed, where each wording comes from:
#   "can't allocate memory": a host allocation (c10's DefaultCPUAllocator, and the budget allocator in its words);
#   "out of memory": the caching allocator's "CUDA out of memory. ...", and the CUDA runtime's text of
#     cudaErrorMemoryAllocation as C10_CUDA_CHECK writes it, "CUDA error: out of memory";
#   CUBLAS_STATUS_ALLOC_FAILED: cuBLAS and cuBLASLt, by the status name ATen's _cublasGetErrorEnum gives, as
#     TORCH_CUDABLAS_CHECK (aten/src/ATen/cuda/Exceptions.h) writes it, "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when
#     calling `cublasCreate(handle)`", and ATen's cublasLtMatmul check (CUDABlas.cpp), "... when calling
#     cublasLtMatmul with transpose_mat1 ...";
#   CUDNN_STATUS_*ALLOC*: cuDNN, by the status name cudnnGetErrorString gives, as AT_CUDNN_CHECK writes it, "cuDNN
#     error: <name>", AT_CUDNN_FRONTEND_CHECK, "cuDNN Frontend error: <call> failed with <name>" (the frontend's
#     CUDNN_BACKEND_API_FAILED), and the v8 frontend's cudnnException, "... cudnn_status: <name>". cuDNN 8 names
#     CUDNN_STATUS_ALLOC_FAILED; cuDNN 9 (cudnn_graph.h) keeps that as a deprecated alias of
#     CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED and names device memory's failure apart.
# Any other status (CUBLAS_STATUS_EXECUTION_FAILED, CUDNN_STATUS_EXECUTION_FAILED, ...) is a fault, not memory.
OUT_OF_MEMORY_MESSAGES = (
    "can't allocate memory",
    "out of memory",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED",
    "CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED",
)


def is_out_of_memory(err: BaseException) -> bool:
    """CUDA's OutOfMemoryError, the budget allocator's (the same type), a failed host allocation, or cuBLAS or cuDNN
    failing to allocate (RuntimeErrors that name their status): each means a smaller batch may fit."""
    import torch

    if isinstance(err, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(err, RuntimeError) and any(m in str(err) for m in OUT_OF_MEMORY_MESSAGES)

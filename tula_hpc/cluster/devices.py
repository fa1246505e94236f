"""What running on GPUs rather than CPUs implies, decided here: whether this host's CUDA gives each rank a GPU
of its own, and what sync costs where the profiles cannot tell (the presets of search.sync_prior).

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

SYNC_KINDS = ("intra_node", "inter_node")  # sync among one host's ranks, and among hosts

# search.sync_prior when a job writes none, by its device (see the performance module's docstring for the terms).
# Whole figures are ints, as YAML reads them: results fingerprinted when jobs wrote these figures still match.
SYNC_PRIORS = {
    # NCCL on a GPU cluster. Latency: NCCL's own tuning model (src/graph/tuning.cc, ring, Simple protocol) counts
    # 3.4 us per NVLink hop, 5.7 us per PCIe hop and 14 us per network hop. Bandwidth: NVLink class within a node,
    # below the per-direction link rate a ring cannot exceed (V100 NVLink 2: 150 GB/s, A100 NVLink 3: 300 GB/s;
    # PCIe-only nodes reach about 20); across nodes one 100 Gb/s NIC per node (EDR InfiniBand, 100 Gb Ethernet).
    "gpu": {
        "intra_node": {"latency_s": 5e-6, "bandwidth_gb_s": 100},
        "inter_node": {"latency_s": 1.4e-5, "bandwidth_gb_s": 12.5},
    },
    # gloo on CPU hosts: tens of us per hop and about 1 GB/s through loopback TCP among one host's ranks, more
    # latency over the network; orders of magnitude, which the profiles replace wherever they hold that sync.
    "cpu": {
        "intra_node": {"latency_s": 5e-5, "bandwidth_gb_s": 1},
        "inter_node": {"latency_s": 1e-4, "bandwidth_gb_s": 1},
    },
}


# search.sync_fit and search.discrepancy_per_octave when a job writes none, by its device (see the performance
# model's docstring). GPUs: latent sync, as the step overlaps it (timing the all-reduce alone after a barrier
# perturbs the overlap), and the discrepancy that puts 60-75 % of the Pollux GPU traces' out-of-sample errors
# inside the 1-sigma band (bench/trace_accuracy.py, chosen there). CPUs: split parts (gloo's threads slow the
# compute they run beside, which the split fit measures) and the prior that the CPU benchmark was tuned with.
FIT_DEFAULTS = {
    "gpu": {"sync_fit": "latent", "discrepancy_per_octave": 0.08},
    "cpu": {"sync_fit": "split", "discrepancy_per_octave": 0.02},
}


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


def sync_device(gpus_per_node: int) -> str:
    """The SYNC_PRIORS preset of a job: NCCL's on GPUs, gloo's on CPUs."""
    return "gpu" if gpus_per_node > 0 else "cpu"


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


def rank_gpu(local_rank: int) -> int:
    """The GPU of a rank: its node's `local_rank`-th. Never the CPU in its stead (a GPU job's profiles and
    training would silently measure something else), nor a GPU another rank holds (NCCL refuses two ranks
    on one GPU)."""
    gpus = usable_gpus()
    if not gpus:
        raise DeviceError(
            f"this GPU job's rank {local_rank} finds CUDA unusable ({cuda_setup()}); a driver older than the "
            f"wheel's CUDA or a CUDA_VISIBLE_DEVICES that names no GPU does this: update the driver, install a "
            f"torch wheel built for the driver's CUDA, or name the GPUs"
        )
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

"""The device memory budget: `resources.device_memory_gb` (or the device's own memory) enforced on the rank's device.

On a GPU the caching allocator is capped with torch.cuda.set_per_process_memory_fraction. On the CPU a
small allocator (csrc/cpu_budget.cpp, built once with torch.utils.cpp_extension) counts every tensor
byte and refuses an allocation beyond the budget with PyTorch's own out-of-memory error, where it
happens: the CPU counterpart of the GPU cap. An address-space limit (RLIMIT_AS) was measured and
rejected: oneDNN maps 6-90 MB of kernel code per new input shape and glibc's heap keeps 16-36 % above
the live tensors (exact only with a fixed mmap threshold, which slows CPU training 1.5-2.4x), so it
fails at batches the device could hold.

Memory probing and training both run under it; torch is imported lazily so that the stages' drivers,
which only size budgets, stay light. What the device holds is counted here too: the model, the optimiser's state,
the tensors a forward pass saves, what a CUDA out-of-memory error says was reserved, NCCL's buffers.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from tula_hpc.core.run_layout import devices_per_node

if TYPE_CHECKING:
    from tula_hpc.core.job import Job

GB = 1e9
# The torch.cuda counter of each figure a peak is read in (_DeviceMemory.peak).
PEAK_COUNTS = {"allocated": "max_memory_allocated", "reserved": "max_memory_reserved"}
# The caching allocator's event counts (torch.cuda.memory_stats): a retry is a malloc that failed, freed every cached
# block (synchronising the device) and tried again; an OOM one that failed after the retry.
ALLOCATOR_EVENTS = ("num_alloc_retries", "num_ooms")
CPU_BUDGET_SOURCE = Path(__file__).resolve().parent / "csrc" / "cpu_budget.cpp"
# A size in a CUDA out-of-memory message, as c10's format_size writes it: "N bytes" up to 1 KiB, else two decimals
# of KiB, MiB (up to 1 GiB) or GiB.
SIZE_UNITS = {"bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
_SIZE = r"(\d+(?:\.\d+)?) (bytes|KiB|MiB|GiB)"
# The parts of the caching allocator's message (c10/cuda/CUDACachingAllocator.cpp, DeviceCachingAllocator::malloc)
# that say what it reserved when it failed: "CUDA out of memory. Tried to allocate <size>. GPU <i> has a total
# capacity of <size> of which <size> is free. [Including non-PyTorch memory, this process has <size> memory in use.
# ][<size> allowed; ]Of the allocated memory <size> is allocated by PyTorch, [with <size> allocated in private pools
# (e.g., CUDA Graphs), ]and <size> is reserved by PyTorch but unallocated. ...". "Of the allocated memory" counts
# the private pools too, so its two figures add up to all the allocator reserved.
CUDA_OOM_PARTS = (
    rf"Tried to allocate {_SIZE}\.",
    rf"Of the allocated memory {_SIZE} is allocated by PyTorch,",
    rf"and {_SIZE} is reserved by PyTorch but unallocated\.",
)
# NCCL's buffers for one connection to a peer on one channel, at NCCL's defaults (NVIDIA/nccl src/init.cc
# DEFAULT_*BUFFSIZE from src/include/device.h's constants; NCCL_BUFFSIZE in NCCL's environment-variable docs), each
# overridden by its environment variable:
#   Simple: NCCL_BUFFSIZE, "The default is 4194304 (4 MB)"                                        = 4,194,304
#   LL:     NCCL_LL_LINES_PER_THREAD 8 x NCCL_LL_MAX_NTHREADS 512 x NCCL_STEPS 8 x 16-byte line  =   524,288
#   LL128:  NCCL_LL128_ELEMS_PER_THREAD 120 x NCCL_LL128_MAX_NTHREADS 640 x NCCL_STEPS 8 x 8 bytes = 4,915,200
NCCL_PROTOCOL_BUFFERS = {
    "NCCL_BUFFSIZE": 4 * 2**20,
    "NCCL_LL_BUFFSIZE": 8 * 512 * 8 * 16,
    "NCCL_LL128_BUFFSIZE": 120 * 640 * 8 * 8,
}
NCCL_RING_PEERS = 2  # a rank of a ring receives from the rank before it and sends to the one after
# Channels NCCL opens are chosen per topology (a couple on PCIe or one NIC, up to 32 on NVLink switches; the docs
# allow NCCL_MIN_NCHANNELS up to 32 since NCCL 2.5): assumed the most unless NCCL_MAX_NCHANNELS bounds them.
NCCL_CHANNELS = 32


class DeviceBudgetError(RuntimeError):
    """The device budget cannot hold what must live on the device before any step runs."""


@functools.cache
def cpu_allocator() -> ctypes.CDLL:
    """The budget allocator's library, compiled on first use (cached by torch under ~/.cache/torch_extensions)."""
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    from torch.utils import cpp_extension

    # Named by the source's hash, so an edited source is built anew rather than loaded stale from the cache.
    name = "tula_cpu_budget_" + hashlib.sha1(CPU_BUDGET_SOURCE.read_bytes()).hexdigest()[:12]
    library = ctypes.CDLL(
        cpp_extension.load(name=name, sources=[str(CPU_BUDGET_SOURCE)], is_python_module=False, extra_cflags=["-O2"])
    )
    for function in ("tula_used", "tula_peak", "tula_failed_at"):
        getattr(library, function).restype = ctypes.c_int64
    return library


class _DeviceMemory:
    """What this process holds on its device, counted from the moment a budget is set.

    The CPU allocator counts from its install; `origin` is its count when the budget was set, and
    `resident` the bytes already on the device then (the built model), which it could not count.
    """

    device = None
    resident = origin = 0

    def limit(self, device, budget_bytes: int, resident_bytes: int, job: Job) -> None:
        """From now on the device holds at most `budget_bytes`: an allocation beyond fails as out of memory."""
        import torch

        if device.type == "cuda":
            resident_bytes = torch.cuda.memory_allocated(device)
        if resident_bytes >= budget_bytes:
            raise DeviceBudgetError(
                f"job '{job.name}': field 'resources.device_memory_gb': a budget of {budget_bytes:,} bytes cannot "
                f"hold {job.model.name} at all: the model alone needs {resident_bytes:,} bytes"
            )
        self.device = device
        if device.type == "cuda":
            total = self.card_bytes(device)
            if budget_bytes < total:  # never silently: the user may have meant another card
                print(
                    f"[tula-hpc] {device} has {total / GB:.1f} GB; capped to {budget_bytes / GB:.1f} GB by "
                    f"{budget_source(job)}",
                    flush=True,
                )
            torch.cuda.set_per_process_memory_fraction(min(1.0, budget_bytes / total), device)
            torch.cuda.reset_peak_memory_stats(device)
            return
        library = cpu_allocator()
        library.tula_install()
        self.resident, self.origin = resident_bytes, library.tula_used()
        library.tula_set_limit(ctypes.c_int64(self.origin + budget_bytes - resident_bytes))
        library.tula_reset_peak()

    def lift(self) -> None:
        """No budget any more (the next run in this process sets its own)."""
        import torch

        if self.device is not None and self.device.type == "cuda":
            torch.cuda.set_per_process_memory_fraction(1.0, self.device)
        elif self.device is not None:
            cpu_allocator().tula_set_limit(ctypes.c_int64(2**63 - 1))
        self.device = None

    def _count(self, device, cpu_count: str, cuda_count: str) -> int:
        import torch

        if device.type == "cuda":
            return getattr(torch.cuda, cuda_count)(device)
        return self.resident + getattr(cpu_allocator(), cpu_count)() - self.origin

    def in_use(self, device) -> int:
        return self._count(device, "tula_used", "memory_allocated")

    def peak(self, device, figure: str = "allocated") -> int:
        """The most the device held since the budget was set or `reset_peak`: in tensors (`allocated`), or in
        the blocks the allocator took from the device to hold them (`reserved`).

        CUDA's caching allocator reserves more than it hands out (blocks rounded up, segments split, freed
        blocks kept for reuse), and its cap (the budget) and its out-of-memory errors apply to what it
        reserves. The CPU budget allocator reserves exactly what it allocates: one count serves both.
        """
        return self._count(device, "tula_peak", PEAK_COUNTS[figure])

    def outside_allocator(self, device) -> int:
        """Device memory this process's allocator does not hold (the CUDA context, other processes): the part of
        the card that no budget can give to the steps. Nothing on the CPU, where the budget is all there is."""
        import torch

        if device.type != "cuda":
            return 0
        free, total = torch.cuda.mem_get_info(device)
        return total - free - torch.cuda.memory_reserved(device)

    def outside_allocator_with(self, device, collectives: bool) -> tuple[int, int]:
        """(`outside_allocator`, of it NCCL's communicator's), with `collectives` once NCCL is set up on a GPU.

        A one-rank group (as memory.trial_step forms one) runs an all_reduce, so that NCCL allocates its
        communicator (with cudaMalloc, outside the allocator) before the reading; its part is the difference.
        """
        import torch
        import torch.distributed as dist

        from tula_hpc.cluster.devices import join_one_rank_group

        before = self.outside_allocator(device)
        if device.type != "cuda" or not collectives:
            return before, 0
        join_one_rank_group(device)
        try:
            dist.all_reduce(torch.ones(1, device=device))
            torch.cuda.synchronize(device)
            after = self.outside_allocator(device)
        finally:
            dist.destroy_process_group()
        return after, after - before

    def card_bytes(self, device) -> int | None:
        """The card's memory, on a GPU."""
        import torch

        return torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None

    def failed_at(self, device, err: BaseException) -> int:
        """Bytes the allocation that failed with `err` would have brought the device to: a lower bound of the need.

        The CPU allocator counts it. On a GPU the caching allocator's message says what it had reserved (the figure
        its cap applies to) and the block it tried to add (`cuda_failed_at`); an error from elsewhere (cuBLAS, an
        unfamiliar wording) leaves the most it reserved, which says only that the need is above it.
        """
        import torch

        if device.type != "cuda":
            return self.resident + cpu_allocator().tula_failed_at() - self.origin
        return cuda_failed_at(str(err)) or torch.cuda.max_memory_reserved(device)

    def allocator_events(self, device) -> dict[str, int]:
        """The caching allocator's ALLOCATOR_EVENTS so far; none on the CPU, whose budget allocator never retries."""
        import torch

        if device.type != "cuda":
            return {}
        stats = torch.cuda.memory_stats(device)
        return {event: stats.get(event, 0) for event in ALLOCATOR_EVENTS}

    def release(self, device) -> None:
        """Give back what a finished run held: its garbage, its budget, the allocator's cache and peaks."""
        import gc

        import torch

        gc.collect()
        self.lift()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)

    def reset_peak(self, device) -> None:
        import torch

        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        else:
            cpu_allocator().tula_reset_peak()


device_memory = _DeviceMemory()


def _size_bytes(number: str, unit: str) -> int:
    return round(float(number) * SIZE_UNITS[unit])


def cuda_failed_at(message: str) -> int | None:
    """What the caching allocator had reserved when it failed plus the block it tried to reserve, from its
    out-of-memory `message` (to format_size's two decimals); None if the message does not say."""
    found = [re.search(part, message) for part in CUDA_OOM_PARTS]
    if not all(found):
        return None
    return sum(_size_bytes(*match.groups()) for match in found)


def runs_on_several_devices(job: Job) -> bool:
    """Whether a run of the job may span devices: DDP's gradient copy and NCCL's buffers then take room too."""
    return job.search.nodes.max * max(1, job.resources.gpus_per_node) > 1


def nccl_ring_buffer_bytes(env: Mapping[str, str]) -> int:
    """NCCL's buffers for a ring on every channel (NCCL_PROTOCOL_BUFFERS, NCCL_CHANNELS): device memory outside
    the allocator that a one-rank probe cannot see, as its communicator has no peers."""
    per_connection = sum(int(env.get(name, default)) for name, default in NCCL_PROTOCOL_BUFFERS.items())
    return int(env.get("NCCL_MAX_NCHANNELS", NCCL_CHANNELS)) * NCCL_RING_PEERS * per_connection


def budget_bytes(job: Job, device) -> int:
    """The memory a rank on `device` may use: resources.device_memory_gb, or with `auto` the device's own.

    A GPU's own is its card's memory. On the CPU it is the host memory the job asks of each node
    (resources.mem_gb), shared by the node's ranks.
    """
    resources = job.resources
    if resources.device_memory_gb != "auto":
        return int(resources.device_memory_gb * GB)
    if device.type == "cuda":
        return device_memory.card_bytes(device)
    return int(resources.mem_gb * GB / devices_per_node(job))


def budget_source(job: Job) -> str:
    """Which budget applied, in words for memory.json and the report."""
    if job.resources.device_memory_gb == "auto":
        return "the device's own memory (resources.device_memory_gb: auto)"
    return f"resources.device_memory_gb: {job.resources.device_memory_gb}"


def usable_bytes(job: Job, budget: int) -> int:
    """The part of `budget` the largest batch may fill, resources.memory_headroom kept free."""
    return int(budget * (1 - job.resources.memory_headroom))


def model_bytes(model) -> int:
    """Parameters and buffers: what a built model holds on its device before any step."""
    return sum(t.nbytes for t in [*model.parameters(), *model.buffers()])


def storage_key(tensor) -> int:
    """Where a tensor's memory is: tensors with one key share it (views, a parameter's .data)."""
    return tensor.untyped_storage().data_ptr()


def optimizer_state_bytes(optimizer) -> int:
    """The tensors the optimiser keeps per parameter (momentum, Adam's moments), each storage once."""
    tensors = [t for state in optimizer.state.values() for t in state.values() if hasattr(t, "untyped_storage")]
    return sum({storage_key(t): t.untyped_storage().nbytes() for t in tensors}.values())


def derived_from_parameters(tensor) -> bool:
    """Whether autograd derives `tensor` from parameters alone, step by one-input step (autocast's bf16 or fp16 copy
    of a weight, views of it): memory that does not grow with the batch."""
    node = tensor.grad_fn
    while node is not None and len(node.next_functions) == 1:
        node = node.next_functions[0][0]
    return node is not None and hasattr(node, "variable")  # autograd's AccumulateGrad of a parameter


def saved_tensor_bytes(model, loss_of, batch, precision) -> tuple[int, int]:
    """Bytes of the tensors autograd saves for backward in a forward pass at the job's precision (parameters
    and the batch excluded): (activations, autocast's copies of the weights). `loss_of(model, batch)` is the task's
    (tasks.Task.loss_of); `batch` a pair or a dict of tensors."""
    import torch
    from torch.utils._pytree import tree_flatten

    batch = precision.inputs(batch)
    skip = {storage_key(t) for t in [*model.parameters(), *tree_flatten(batch)[0]]}
    saved: dict[int, int] = {}
    weight_copies: set[int] = set()

    def see(tensor):
        if storage_key(tensor) not in skip:
            saved[storage_key(tensor)] = tensor.untyped_storage().nbytes()
            if derived_from_parameters(tensor):
                weight_copies.add(storage_key(tensor))
        # Kept detached: a saved output packed as itself holds its own grad_fn, a cycle through autograd's C++ graph
        # that Python's gc cannot see, so the whole step would outlive this function (found in one-process probes).
        return tensor.detach()

    with torch.autograd.graph.saved_tensors_hooks(see, lambda t: t), precision.autocast():
        loss = loss_of(model, batch)
    del loss
    copies = sum(saved[key] for key in weight_copies)
    return sum(saved.values()) - copies, copies

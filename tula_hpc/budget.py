"""The device memory budget: `resources.device_memory_gb` (or the device's own memory) enforced on the rank's device.

On a GPU the caching allocator is capped with torch.cuda.set_per_process_memory_fraction. On the CPU a
small allocator (csrc/cpu_budget.cpp, built once with torch.utils.cpp_extension) counts every tensor
byte and refuses an allocation beyond the budget with PyTorch's own out-of-memory error, where it
happens: the CPU counterpart of the GPU cap. An address-space limit (RLIMIT_AS) was measured and
rejected: oneDNN maps 6-90 MB of kernel code per new input shape and glibc's heap keeps 16-36 % above
the live tensors (exact only with a fixed mmap threshold, which slows CPU training 1.5-2.4x), so it
fails at batches the device could hold.

Memory probing and training both run under it; torch is imported lazily so that the stages' drivers,
which only size budgets, stay light.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
from pathlib import Path

from .layout import devices_per_node

GB = 1e9
OUT_OF_MEMORY_MESSAGES = ("can't allocate memory", "out of memory")
# The torch.cuda counter of each figure a peak is read in (_DeviceMemory.peak).
PEAK_COUNTS = {"allocated": "max_memory_allocated", "reserved": "max_memory_reserved"}
CPU_BUDGET_SOURCE = Path(__file__).resolve().parent / "csrc" / "cpu_budget.cpp"


class DeviceBudgetError(RuntimeError):
    """The device budget cannot hold what must live on the device before any step runs."""


def is_out_of_memory(err: BaseException) -> bool:
    """CUDA's OutOfMemoryError, the budget allocator's (the same type) or a failed host allocation."""
    import torch

    if isinstance(err, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(err, RuntimeError) and any(m in str(err) for m in OUT_OF_MEMORY_MESSAGES)


@functools.cache
def _cpu_allocator() -> ctypes.CDLL:
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

    def limit(self, device, budget_bytes: int, resident_bytes: int, job: dict) -> None:
        """From now on the device holds at most `budget_bytes`: an allocation beyond fails as out of memory."""
        import torch

        if device.type == "cuda":
            resident_bytes = torch.cuda.memory_allocated(device)
        if resident_bytes >= budget_bytes:
            raise DeviceBudgetError(
                f"job '{job['name']}': field 'resources.device_memory_gb': a budget of {budget_bytes:,} bytes cannot "
                f"hold {job['model']['name']} at all: the model alone needs {resident_bytes:,} bytes"
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
        library = _cpu_allocator()
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
            _cpu_allocator().tula_set_limit(ctypes.c_int64(2**63 - 1))
        self.device = None

    def _count(self, device, cpu_count: str, cuda_count: str) -> int:
        import torch

        if device.type == "cuda":
            return getattr(torch.cuda, cuda_count)(device)
        return self.resident + getattr(_cpu_allocator(), cpu_count)() - self.origin

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

    def card_bytes(self, device) -> int | None:
        """The card's memory, on a GPU."""
        import torch

        return torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None

    def failed_at(self, device) -> int | None:
        """Bytes the last refused allocation would have brought the device to: a lower bound of the need (CPU)."""
        return None if device.type == "cuda" else self.resident + _cpu_allocator().tula_failed_at() - self.origin

    def reset_peak(self, device) -> None:
        import torch

        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        else:
            _cpu_allocator().tula_reset_peak()


device_memory = _DeviceMemory()


def budget_bytes(job: dict, device) -> int:
    """The memory a rank on `device` may use: resources.device_memory_gb, or with `auto` the device's own.

    A GPU's own is its card's memory. On the CPU it is the host memory the job asks of each node
    (resources.mem_gb), shared by the node's ranks.
    """
    resources = job["resources"]
    if resources["device_memory_gb"] != "auto":
        return int(resources["device_memory_gb"] * GB)
    if device.type == "cuda":
        return device_memory.card_bytes(device)
    return int(resources["mem_gb"] * GB / devices_per_node(job))


def budget_source(job: dict) -> str:
    """Which budget applied, in words for memory.json and the report."""
    if job["resources"]["device_memory_gb"] == "auto":
        return "the device's own memory (resources.device_memory_gb: auto)"
    return f"resources.device_memory_gb: {job['resources']['device_memory_gb']}"


def usable_bytes(job: dict, budget: int) -> int:
    """The part of `budget` the largest batch may fill, resources.memory_headroom kept free."""
    return int(budget * (1 - job["resources"]["memory_headroom"]))


def model_bytes(model) -> int:
    """Parameters and buffers: what a built model holds on its device before any step."""
    return sum(t.nbytes for t in [*model.parameters(), *model.buffers()])

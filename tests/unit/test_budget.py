"""The device memory budget: allocations beyond it fail for real, as PyTorch's own out-of-memory error. What the
device holds: a CUDA out-of-memory message read, NCCL's buffers counted (with stand-ins for torch.cuda and
torch.distributed: no GPU here), the optimiser's state and the tensors a forward pass saves."""

import pytest
import torch
import torch.distributed as dist
import yaml
from torch import nn

from tests.conftest import default_job, job_config
from tula_hpc.cluster.devices import is_out_of_memory
from tula_hpc.config import ConfigError, load_config
from tula_hpc.memory.device_budget import (
    GB,
    DeviceBudgetError,
    budget_bytes,
    budget_source,
    cuda_failed_at,
    device_memory,
    nccl_ring_buffer_bytes,
    optimizer_state_bytes,
    saved_tensor_bytes,
    usable_bytes,
)
from tula_hpc.training.precision import Precision
from tula_hpc.training.tasks import ImageClassification

CUDA = torch.device("cuda", 0)
GiB, MiB, KiB = 2**30, 2**20, 2**10


@pytest.mark.spawns
def test_the_budget_makes_allocations_fail_for_real_and_is_lifted():
    job = default_job()
    device = torch.device("cpu")
    device_memory.limit(device, budget_bytes=2_000_000, resident_bytes=500_000, job=job)
    try:
        kept = torch.empty(1_000_000, dtype=torch.uint8)
        assert device_memory.in_use(device) == 1_500_000
        with pytest.raises(torch.OutOfMemoryError, match="can't allocate memory") as failure:
            torch.empty(600_000, dtype=torch.uint8)
        assert is_out_of_memory(failure.value) and device_memory.failed_at(device, failure.value) == 2_100_000
        del kept
        torch.empty(1_400_000, dtype=torch.uint8)
        assert device_memory.peak(device) == 1_900_000
    finally:
        device_memory.lift()
    torch.empty(10_000_000, dtype=torch.uint8)
    with pytest.raises(DeviceBudgetError, match=r"job 'digits-cnn': .* the model alone needs 3,000,000 bytes"):
        device_memory.limit(device, budget_bytes=2_000_000, resident_bytes=3_000_000, job=job)


def test_auto_is_the_devices_own_memory_and_a_figure_is_taken_as_written():
    """On the CPU the device is the host memory the job asks of a node (resources.mem_gb), shared by its ranks."""
    cpu = torch.device("cpu")
    auto = default_job(resources={"device_memory_gb": "auto", "mem_gb": 8})
    assert budget_bytes(auto, cpu) == 8 * GB
    assert budget_source(auto) == "the device's own memory (resources.device_memory_gb: auto)"
    written = default_job(resources={"device_memory_gb": 0.5, "mem_gb": 8})
    assert budget_bytes(written, cpu) == 0.5 * GB and budget_source(written) == "resources.device_memory_gb: 0.5"
    assert usable_bytes(written, budget_bytes(written, cpu)) == 0.45 * GB  # the default 10 % headroom kept free


def test_device_memory_is_a_positive_figure_or_auto(tmp_path):
    (tmp_path / "jobs.yaml").write_text(yaml.safe_dump(job_config(resources={"device_memory_gb": "all"})))
    with pytest.raises(ConfigError, match=r"resources.device_memory_gb"):
        load_config([tmp_path / "jobs.yaml"])


# --- a CUDA out-of-memory error ------------------------------------------------------------------------------


def cuda_out_of_memory_message(tried: str, allocated: str, unallocated: str, allowed: str = "", pools: str = "") -> str:
    """The caching allocator's message, worded as c10/cuda/CUDACachingAllocator.cpp words it."""
    return (
        f"CUDA out of memory. Tried to allocate {tried}. GPU 0 has a total capacity of 79.19 GiB of which 1.25 GiB "
        f"is free. Including non-PyTorch memory, this process has 77.93 GiB memory in use. {allowed}Of the allocated "
        f"memory {allocated} is allocated by PyTorch, {pools}and {unallocated} is reserved by PyTorch but unallocated. "
        "If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
        "to avoid fragmentation.  See documentation for Memory Management  (https://pytorch.org/docs/stable/notes/"
        "cuda.html#environment-variables)"
    )


@pytest.mark.parametrize(
    "message, reached",
    [
        (cuda_out_of_memory_message("2.00 GiB", "75.10 GiB", "1.32 GiB"), (2.00 + 75.10 + 1.32) * GiB),
        # Under set_per_process_memory_fraction (the budget) the message names the cap too.
        (cuda_out_of_memory_message("20.00 MiB", "9.50 GiB", "12.00 MiB", "10.00 GiB allowed; "), 9.5 * GiB + 32 * MiB),
        (cuda_out_of_memory_message("512 bytes", "1.50 KiB", "1024 bytes"), 512 + 1.5 * KiB + 1024),
        # CUDA graphs' private pools are named, and counted in the allocated figure.
        (
            cuda_out_of_memory_message(
                "2.00 MiB",
                "3.00 GiB",
                "4.00 MiB",
                pools="with 1.00 GiB allocated in private pools (e.g., CUDA Graphs), ",
            ),
            3 * GiB + 6 * MiB,
        ),
    ],
)
def test_a_cuda_out_of_memory_message_gives_what_the_allocator_reserved_and_the_block_it_tried(message, reached):
    assert cuda_failed_at(message) == pytest.approx(reached, abs=1)


def test_a_message_that_does_not_say_gives_nothing():
    assert cuda_failed_at("CUDA error: out of memory") is None
    assert cuda_failed_at("CUDA out of memory. Tried to allocate 2.00 GiB.") is None


def test_on_a_gpu_the_failure_is_read_from_the_error_else_the_peak_reserved(monkeypatch):
    """Without it a GPU trial that ran out of memory recorded nothing, and the retry went one sample down."""
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device: 7 * GiB)
    allocator = torch.OutOfMemoryError(cuda_out_of_memory_message("2.00 GiB", "75.10 GiB", "1.32 GiB"))
    assert is_out_of_memory(allocator)
    assert device_memory.failed_at(CUDA, allocator) == pytest.approx(78.42 * GiB, abs=1)
    assert device_memory.failed_at(CUDA, RuntimeError("CUBLAS_STATUS_ALLOC_FAILED: out of memory")) == 7 * GiB


@pytest.mark.parametrize(
    "message",
    [
        "CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported at some other API call, so the "
        "stacktrace below might be incorrect.",
        "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
        "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasLtMatmul with transpose_mat1 1 transpose_mat2 0 "
        "m 4096 n 8192 k 1024 mat1_ld 1024 mat2_ld 1024 result_ld 4096 abcType 14 computeType 68 scaleType 0",
        "cuDNN error: CUDNN_STATUS_ALLOC_FAILED",
        "cuDNN error: CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED",
        "cuDNN error: CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED",
        "cuDNN Frontend error: detail::finalize(plan->get_backend_descriptor()) failed with "
        "CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED",
        "CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR: cudnnFinalize Descriptor Failed cudnn_status: "
        "CUDNN_STATUS_ALLOC_FAILED",
    ],
    ids=["cuda", "cublas", "cublaslt", "cudnn8", "cudnn9-host", "cudnn9-device", "cudnn-frontend", "cudnn-v8-plan"],
)
def test_cuda_cublas_and_cudnn_allocation_failures_are_out_of_memory(message):
    """cuBLAS and cuDNN name their allocation failures in their own words: a smaller batch may fit after each."""
    assert is_out_of_memory(RuntimeError(message))


def test_a_cublas_execution_failure_or_another_runtime_error_is_not_out_of_memory():
    execution = (
        "CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm( handle, opa, opb, m, n, k, &alpha, a, "
        "lda, b, ldb, &beta, c, ldc)`"
    )
    assert not is_out_of_memory(RuntimeError(execution))
    assert not is_out_of_memory(RuntimeError("cuDNN error: CUDNN_STATUS_EXECUTION_FAILED"))
    assert not is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied (64x512 and 256x10)"))


# --- NCCL's buffers ------------------------------------------------------------------------------------------


def test_a_ring_reserves_nccls_protocol_buffers_for_two_peers_on_every_channel():
    per_connection = 4 * MiB + 8 * 512 * 8 * 16 + 120 * 640 * 8 * 8  # Simple, LL, LL128 at NCCL's defaults
    assert per_connection == 9_633_792
    assert nccl_ring_buffer_bytes({}) == 32 * 2 * per_connection
    bounded = {"NCCL_MAX_NCHANNELS": "4", "NCCL_BUFFSIZE": str(MiB)}
    assert nccl_ring_buffer_bytes(bounded) == 4 * 2 * (MiB + 8 * 512 * 8 * 16 + 120 * 640 * 8 * 8)


@pytest.fixture
def fake_nccl(monkeypatch):
    """torch.distributed, torch.cuda and the card's free memory stood in for: the card holds 300 MB outside the
    allocator, 40 MB more once a group's all_reduce has set NCCL up."""
    calls = []

    def outside_allocator(device):
        return 340_000_000 if "all_reduce" in calls and "destroy" not in calls else 300_000_000

    def ones(*shape, device=None):
        calls.append(("tensor on", device))
        return torch.zeros(*shape)

    monkeypatch.setattr(device_memory, "outside_allocator", outside_allocator)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.append(("group", backend, kw)))
    monkeypatch.setattr(dist, "all_reduce", lambda tensor: calls.append("all_reduce"))
    monkeypatch.setattr(dist, "destroy_process_group", lambda: calls.append("destroy"))
    monkeypatch.setattr(torch, "ones", ones)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device: calls.append("synchronize"))
    return calls


def test_a_gpu_probe_of_a_multi_device_job_measures_nccls_communicator_outside_the_allocator(fake_nccl):
    assert device_memory.outside_allocator_with(CUDA, collectives=True) == (340_000_000, 40_000_000)
    group, tensor, *rest = fake_nccl
    assert group[:2] == ("group", "cpu:gloo,cuda:nccl") and group[2]["rank"] == 0 and group[2]["world_size"] == 1
    assert tensor == ("tensor on", CUDA) and rest == ["all_reduce", "synchronize", "destroy"]


@pytest.mark.parametrize("device, collectives", [(CUDA, False), (torch.device("cpu"), True)])
def test_one_device_or_the_cpu_forms_no_group(fake_nccl, device, collectives):
    assert device_memory.outside_allocator_with(device, collectives) == (300_000_000, 0)
    assert fake_nccl == []


# --- what tensors hold ---------------------------------------------------------------------------------------


def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 8 * 8, 10))


def test_an_optimisers_state_is_counted_from_its_tensors():
    model = tiny_model()
    momentum = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    assert optimizer_state_bytes(momentum) == 0  # none before the first step
    model(torch.randn(4, 3, 8, 8)).sum().backward()
    momentum.step()
    assert optimizer_state_bytes(momentum) == sum(p.nbytes for p in model.parameters())


def test_adamws_two_moments_are_counted_twice_the_parameters_where_momentum_is_once():
    """Read off optimizer.state after a step: AdamW's exp_avg and exp_avg_sq are two parameter-sized tensors (plus
    its 4-byte step counter per tensor), SGD's momentum buffer one."""
    params = {}
    for name, build in {
        "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.1),
    }.items():
        model = tiny_model()
        optimizer = build(model.parameters())
        model(torch.randn(4, 3, 8, 8)).sum().backward()
        optimizer.step()
        params[name] = list(model.parameters()), optimizer_state_bytes(optimizer)
    weights, sgd = params["sgd"]
    assert sgd == sum(p.nbytes for p in weights)
    weights, adamw = params["adamw"]
    assert adamw == 2 * sum(p.nbytes for p in weights) + 4 * len(weights)


def test_autocasts_weight_copies_are_counted_apart_from_saved_activations():
    """CPU autocast to bf16 casts the conv's and the linear layer's weights, and saves the copies for backward."""
    model, loss_of = tiny_model(), ImageClassification().loss_of
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,))
    weight_copies = sum(p.numel() * 2 for p in model.parameters() if p.ndim > 1)  # bf16: 2 bytes an element
    activations, copies = saved_tensor_bytes(model, loss_of, [x, y], Precision("bf16", torch.device("cpu")))
    assert copies == weight_copies
    # In bf16 the saved activations are the fp32 ones' conv and linear inputs at half the size, never a weight.
    fp32_activations, no_copies = saved_tensor_bytes(model, loss_of, [x, y], Precision("fp32", torch.device("cpu")))
    assert no_copies == 0 and activations < fp32_activations < activations + copies

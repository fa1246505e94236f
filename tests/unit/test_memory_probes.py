"""memory_probes: a real probe and real trials in fresh processes, and a trial on a (simulated) card that runs out
of memory."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.conftest import default_job
from tests.unit.test_budget import CUDA, GiB, MiB, cuda_out_of_memory_message
from tests.unit.test_memory_model import ANY_CAP, fits
from tula_hpc.cluster.devices import DeviceError
from tula_hpc.memory.device_budget import budget_bytes
from tula_hpc.memory.model import StepMemoryModel, next_trial, settle
from tula_hpc.memory.step_parts import PARTS
from tula_hpc.profiling import memory_probes
from tula_hpc.profiling.memory_probes import run_in_fresh_process

# --- real probes and trials -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_probe() -> dict:
    return run_in_fresh_process("measure", job=default_job(), batch=64)


@pytest.mark.spawns
def test_a_probe_measures_every_part_of_the_steady_steps(real_probe):
    assert real_probe["outcome"] == "measured" and set(real_probe["peaks"]) == set(PARTS)
    assert real_probe["peak_bytes"] == max(real_probe["peaks"].values())
    assert min(real_probe["peaks"].values()) > real_probe["param_bytes"] + real_probe["optimizer_bytes"]
    assert real_probe["activation_bytes"] > 0
    assert real_probe["grad_bytes"] == real_probe["param_bytes"]
    # SGD's momentum, counted from its tensors; fp32 makes no weight copies; the CPU has no NCCL.
    assert real_probe["optimizer_bytes"] == real_probe["param_bytes"]
    assert real_probe["autocast_weight_bytes"] == 0 and real_probe["collective_library_bytes"] == 0


@pytest.mark.spawns
def test_a_bf16_probe_counts_autocasts_weight_copies_apart_from_the_activations(real_probe):
    bf16 = run_in_fresh_process("measure", job=default_job(train={"precision": "bf16"}), batch=64)
    assert 0 < bf16["autocast_weight_bytes"] <= bf16["param_bytes"] / 2  # bf16 copies of the weights, not biases
    assert bf16["activation_bytes"] < real_probe["activation_bytes"]
    assert bf16["optimizer_bytes"] == real_probe["optimizer_bytes"]


@pytest.mark.spawns
def test_a_trial_runs_out_of_memory_below_the_probes_peak_and_reaches_it_above(real_probe):
    job = default_job()
    tight = (real_probe["param_bytes"] + real_probe["peak_bytes"]) // 2  # holds the model, not the step
    with ThreadPoolExecutor(max_workers=2) as pool:
        too_small, large = pool.map(
            lambda budget: run_in_fresh_process("trial", job=job, batch=64, budget=budget, ddp=False),
            [tight, budget_bytes(job, torch.device("cpu"))],
        )
    assert too_small["outcome"] == "out_of_memory" and too_small["failed_at_bytes"] > tight
    assert large["outcome"] == "fits"
    assert large["peak_bytes"] == pytest.approx(real_probe["peak_bytes"], rel=0.01)


def _live_tensor_bytes() -> int:
    import gc

    gc.collect()
    return sum(o.nbytes for o in gc.get_objects() if isinstance(o, torch.Tensor) and not o.is_meta)


@pytest.mark.spawns
def test_probes_in_one_process_answer_as_fresh_ones_and_leave_nothing_behind(real_probe):
    """One process runs probe after probe (resources.memory_probes_in): each answers as a fresh process does, and
    none leaves a tensor behind for the next to count (a saved output packed as itself once kept whole steps alive
    through autograd's graph, which Python's gc cannot see)."""
    job, before = default_job(), _live_tensor_bytes()
    answers = [memory_probes.run_in_this_process("measure", job, batch=64) for _ in range(2)]
    assert _live_tensor_bytes() == before
    for answer in answers:
        assert {key: answer[key] for key in ("peak_bytes", "workspace_bytes", "activation_bytes")} == {
            key: real_probe[key] for key in ("peak_bytes", "workspace_bytes", "activation_bytes")
        }
    trial = memory_probes.run_in_this_process(
        "trial", job, batch=64, budget=budget_bytes(job, torch.device("cpu")), ddp=False
    )
    assert trial["outcome"] == "fits" and trial["allocator_events"] == {}  # the CPU's allocator never retries
    assert _live_tensor_bytes() == before


def test_a_gpu_jobs_probe_never_runs_on_the_cpu_in_its_stead(monkeypatch):
    """CUDA unusable where the probe runs: an error naming this host's CUDA, not a CPU-sized budget."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DeviceError, match="CUDA unusable"):
        memory_probes.probe_device(default_job().updated(resources={"gpus_per_node": 1}))
    assert memory_probes.probe_device(default_job().updated(resources={"gpus_per_node": 0})).type == "cpu"


def format_size(size: int) -> str:
    """A size as c10's format_size writes it in an out-of-memory message."""
    if size <= 1024:
        return f"{size} bytes"
    unit = next(unit for unit in ("KiB", "MiB", "GiB") if unit == "GiB" or size <= 1024 * UNIT_BYTES[unit])
    return f"{size / UNIT_BYTES[unit]:.2f} {unit}"


UNIT_BYTES = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def test_gpu_trials_settle_near_the_cards_largest_batch(monkeypatch):
    """A card whose step needs 2 GiB + 50 MiB a sample (in ten 5 MiB blocks a sample), sized by a model that expects
    48 MiB: 20 GiB hold batch 368. The allocator fails at the first block beyond the cap; the retry goes 10 % down,
    fits, and shows the slope. Without reading the error the retry was one sample down and failed too."""
    need = lambda batch: 2 * GiB + 50 * MiB * batch  # noqa: E731

    def trial_step(job, batch, budget, ddp):
        if need(batch) <= budget:
            return fits(batch, need(batch))
        block = 5 * MiB * batch
        reserved = 2 * GiB + block * ((budget - 2 * GiB) // block)
        sizes = (format_size(block), format_size(reserved - 3 * MiB), format_size(3 * MiB))
        raise torch.OutOfMemoryError(cuda_out_of_memory_message(*sizes, allowed=f"{format_size(budget)} allowed; "))

    monkeypatch.setattr(memory_probes, "trial_step", trial_step)
    monkeypatch.setattr(memory_probes, "probe_device", lambda job: CUDA)
    model, available, trials = (
        StepMemoryModel().fit([64, 128], [2 * GiB + 48 * MiB * b for b in (64, 128)]),
        20 * GiB,
        [],
    )
    while (batch := next_trial(model, available, trials, ANY_CAP)) is not None:
        trials.append(
            memory_probes._answer_in_process("trial", default_job(), dict(batch=batch, budget=available, ddp=False))
        )
    assert [(t["batch"], t["outcome"]) for t in trials] == [(384, "out_of_memory"), (345, "fits"), (368, "fits")]
    assert trials[0]["failed_at_bytes"] > available
    assert settle(trials, fallback=128) == (368, True)

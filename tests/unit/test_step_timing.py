"""step_timing: real training steps timed part by part, on a quiet machine."""

import dataclasses
import multiprocessing
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch
from torch.utils.data import Dataset

from tests.conftest import default_job, run_on_two_ranks
from tula_hpc.cluster.distributed import Context
from tula_hpc.profiling import step_timing
from tula_hpc.profiling.step_timing import measure
from tula_hpc.training import step as training_step


@pytest.fixture
def job():
    """The default job, measured as its profile jobs run: one torch thread per rank (cpus_per_task)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    job = default_job(search=dict(warmup_steps=2, steps=3, min_measure_s=0.05, max_attempts=2))
    yield job
    torch.set_num_threads(threads)


def test_measure_times_each_part_of_real_training_steps(job):
    """The job's own training step (AGS by default), its parts timed apart."""
    profile = measure(job, Context(0, 1, 0, torch.device("cpu")), per_device_batch=16)
    median = profile["median"]
    assert median["sync_s"] == 0.0  # one rank has nothing to all-reduce
    assert all(median[part] > 0 for part in ("data_s", "compute_s", "update_s", "step_s"))
    assert profile["steps"] >= 3 and all(len(values) == profile["steps"] for values in profile["per_step"].values())
    assert profile["samples_per_s"] == pytest.approx(16 / median["step_s"])
    assert profile["grad_bytes"] == 4 * 151_306  # float32 gradients of the tiny CNN on 8x8 digits
    assert profile["peak_rss_bytes"] > 0
    assert profile["loader"] is None  # no loader workers: loading is the step's data part


@pytest.mark.spawns
def test_with_loader_workers_the_profile_times_the_loaders_own_pace(job, monkeypatch):
    """A data set whose images each wait 1 ms (a slow file system) behind 2 workers: a batch of 16 every 8 ms at
    best, which the measured steps, drawing on batches made ahead, do not show."""
    from tula_hpc.training.datasets import load_splits

    def slow_train(cfg, seed):
        splits = load_splits(cfg, seed)
        return dataclasses.replace(splits, train=_SlowItems(0.001, splits.train))

    monkeypatch.setattr(training_step, "load_splits", slow_train)
    job = job.updated(data={"num_workers": 2})
    profile = measure(job, Context(0, 1, 0, torch.device("cpu")), per_device_batch=16)
    assert profile["loader"]["workers"] == 2 and profile["loader"]["period_s"] >= 16 * 0.001 / 2


class _SlowItems(Dataset):
    """`items`, each read as from a slow file system (`delay_s`)."""

    def __init__(self, delay_s: float, items):
        self.delay_s, self.items = delay_s, items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        time.sleep(self.delay_s)
        return self.items[i]


@pytest.mark.spawns
def test_an_epoch_end_leaves_no_batch_in_the_workers_hands_before_the_restart_it_times(job):
    """Closing an iterator mid-epoch leaves the batches it asked for with the workers, and a persistent loader's next
    iterator waits for them: the timed restart must not (training's epochs run out before they restart)."""
    runner = step_timing.StepRunner(job.updated(data={"num_workers": 1}), Context(0, 1, 0, torch.device("cpu")), 16)
    next(runner.batches)  # mid-epoch: the worker was asked for batches ahead
    assert runner.loader._iterator._tasks_outstanding > 0
    x, _ = step_timing.on_device(runner._epochs_last_batch(0), torch.device("cpu"))
    assert len(x) == 16 and runner.loader.sampler.skip == (len(runner.splits.train) // 16 - 1) * 16
    assert runner.loader._iterator._tasks_outstanding == 0  # the epoch ran out: nothing asked of the worker


def test_the_measured_steps_are_a_steady_epochs_with_the_strategy_past_its_first_epoch_end(job, monkeypatch):
    """AGS scales every step by its factors from the second epoch on (a kernel per factor on a launch-bound GPU):
    the epoch ends run before the measured steps, so that they pay what training's steady epochs pay."""
    factors_at_measured_steps = []
    split_step = step_timing.StepRunner.split_step

    def recording(runner):
        factors_at_measured_steps.append(len(runner.strategy.optimizer.gradscale))
        return split_step(runner)

    monkeypatch.setattr(step_timing.StepRunner, "split_step", recording)
    measure(job, Context(0, 1, 0, torch.device("cpu")), per_device_batch=16)
    assert factors_at_measured_steps and min(factors_at_measured_steps) > 0


class _HostEvent:
    """A CUDA event's interface without a GPU: stamped when recorded, as the GPU stamps it when reached."""

    def __init__(self, enable_timing: bool):
        assert enable_timing

    def record(self) -> None:
        self.at = time.perf_counter()

    def elapsed_time(self, end: "_HostEvent") -> float:
        return (end.at - self.at) * 1e3  # milliseconds, as CUDA's


@pytest.fixture
def synchronizes(monkeypatch):
    """CUDA's clock on this CPU: its events stamped by the host; the synchronizes it asks for, recorded."""
    calls = []
    monkeypatch.setattr(torch.cuda, "Event", _HostEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", calls.append)
    monkeypatch.setattr(step_timing, "clock_for", training_step.CudaClock)
    return calls


@pytest.fixture(params=["cpu", "cuda"])
def clock(request):
    if request.param == "cuda":
        request.getfixturevalue("synchronizes")
    return training_step.clock_for(torch.device(request.param))


def test_the_parts_between_consecutive_marks_add_up_to_the_step(clock):
    marks = [clock.mark()]
    for _ in range(3):
        time.sleep(0.01)
        marks.append(clock.mark())
    parts = clock.seconds(list(zip(marks, marks[1:])))
    (step,) = clock.seconds([(marks[0], marks[-1])])
    assert all(part >= 0.01 for part in parts) and sum(parts) == pytest.approx(step)


def test_on_a_gpu_the_measured_steps_run_back_to_back_their_events_read_after_one_synchronize(job, synchronizes):
    """Synchronizing at every phase boundary, or at every step's end, would keep the host from queueing work ahead,
    as training does: the measured pairs of an attempt are read once; the warm-up's steps one by one."""
    profile = measure(job, Context(0, 1, 0, torch.device("cpu")), per_device_batch=16)
    steps = profile["warmup_steps"] + len(profile["attempts_interference"])
    # each epoch end: its two steps read once each, the strategy's end waited for before and after; then validation
    # twice and a checkpoint, each waited for before and after (host work between device work)
    epoch_ends = step_timing.EPOCH_ENDS * (2 + 2) + 3 * 2
    assert len(synchronizes) == steps + epoch_ends
    assert profile["median"]["sync_s"] == 0.0
    assert all(profile["median"][part] > 0 for part in ("data_s", "compute_s", "update_s", "step_s"))


def test_a_disturbed_measurement_is_repeated_and_the_quietest_attempt_kept(job, monkeypatch):
    monkeypatch.setattr(step_timing, "BACKOFF_S", 0.0)
    job = job.updated(search=dict(max_attempts=2, interference_tolerance=0.0))  # nothing is quiet: both attempts run
    profile = measure(job, Context(0, 1, 0, torch.device("cpu")), per_device_batch=8)
    attempts = profile["attempts_interference"]
    assert len(attempts) == 2 or attempts[0] == 0.0
    assert profile["interference"] == min(attempts) and 0.0 <= profile["interference"] <= 1.0


@pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0, reason="needs root and unshare(1)")
@pytest.mark.spawns
def test_ranks_under_another_hostname_on_this_machine_count_as_the_same_machine():
    """Slurm nodes in namespaces of one host have their own hostnames but share its CPUs: the profiler must
    not count a fellow rank's CPU time as other users' work."""
    probe = [sys.executable, "-c", "from tula_hpc.profiling.step_timing import _machine_id; print(_machine_id())"]
    renamed = subprocess.run(
        ["unshare", "--uts", "sh", "-c", 'hostname tula-test-node && exec "$@"', "sh", *probe],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert renamed == step_timing._machine_id() != ""


def _burn_cpu(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


@pytest.mark.spawns
def test_cpu_of_processes_the_rank_started_is_its_own_not_interference():
    """DataLoader workers are the job's work: a child that burns CPU counts as the rank's own seconds, whether it
    still runs when read or has ended and been waited for."""
    context = multiprocessing.get_context("spawn")
    before = step_timing._own_cpu_s()
    child = context.Process(target=_burn_cpu, args=(0.6,))
    child.start()
    child.join()
    assert step_timing._own_cpu_s() - before >= 0.5


def _model_with_gradients(seed: int) -> torch.nn.Module:
    """Gradients of 864 B (a channels_last conv), 4 kB (a linear layer) and fewer bytes (biases, a small layer)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3), torch.nn.Flatten(), torch.nn.Linear(8 * 4 * 4, 8), torch.nn.Linear(8, 2)
    ).to(memory_format=torch.channels_last)
    model(torch.randn(4, 3, 6, 6).to(memory_format=torch.channels_last)).sum().backward()
    return model


def test_the_timed_all_reduce_copies_at_most_a_bucket_and_averages_every_gradient(monkeypatch):
    """No flat copy of all gradients: each all-reduced tensor is a gradient itself or a copy of at most the cap.
    Two ranks with the same gradients (all_reduce sums them) must end with those gradients."""
    model = _model_with_gradients(0)
    grads = {p.grad.data_ptr(): p.grad.clone() for p in model.parameters()}
    reduced = []

    def all_reduce_of_two_equal_ranks(tensor):
        reduced.append((tensor.data_ptr() in grads, tensor.numel() * tensor.element_size()))
        tensor.mul_(2)

    monkeypatch.setattr(step_timing.dist, "all_reduce", all_reduce_of_two_equal_ranks)
    step_timing._all_reduce_gradients(model, world_size=2, cap_bytes=2048)
    assert all(in_place or size <= 2048 for in_place, size in reduced)
    assert any(in_place for in_place, _ in reduced) and any(not in_place for in_place, _ in reduced)
    assert sum(size for _, size in reduced) == sum(g.numel() * 4 for g in grads.values())
    for p in model.parameters():
        assert torch.equal(p.grad, grads[p.grad.data_ptr()])
    assert step_timing.BUCKET_CAP_BYTES == 25 * 2**20  # DDP's default bucket_cap_mb


def _all_reduce_in_buckets(rank: int, outdir: str) -> None:
    model = _model_with_gradients(rank)
    step_timing._all_reduce_gradients(model, world_size=2, cap_bytes=2048)
    torch.save([p.grad for p in model.parameters()], f"{outdir}/rank{rank}.pt")


@pytest.mark.spawns
def test_two_ranks_end_with_the_mean_of_their_gradients(tmp_path):
    run_on_two_ranks(_all_reduce_in_buckets, str(tmp_path))
    expected = [
        (a.grad + b.grad) / 2
        for a, b in zip(_model_with_gradients(0).parameters(), _model_with_gradients(1).parameters())
    ]
    for rank in (0, 1):
        for got, want in zip(torch.load(tmp_path / f"rank{rank}.pt"), expected):
            torch.testing.assert_close(got, want)

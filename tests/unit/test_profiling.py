"""Stage profile: real training steps timed part by part, on a quiet machine."""

import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch
import yaml

from tests.conftest import default_job, job_config, run_on_two_ranks
from tula_hpc import profiling, training
from tula_hpc.distributed import Context
from tula_hpc.profiling import measure
from tula_hpc.stage import StageError


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
    monkeypatch.setattr(profiling, "clock_for", training.CudaClock)
    return calls


@pytest.fixture(params=["cpu", "cuda"])
def clock(request):
    if request.param == "cuda":
        request.getfixturevalue("synchronizes")
    return training.clock_for(torch.device(request.param))


def test_the_parts_between_consecutive_marks_add_up_to_the_step(clock):
    marks = [clock.mark()]
    for _ in range(3):
        time.sleep(0.01)
        marks.append(clock.mark())
    parts = clock.seconds(list(zip(marks, marks[1:])))
    (step,) = clock.seconds([(marks[0], marks[-1])])
    assert all(part >= 0.01 for part in parts) and sum(parts) == pytest.approx(step)


def test_on_a_gpu_each_step_is_timed_by_events_read_after_one_synchronize(job, synchronizes):
    """Synchronizing at every phase boundary would keep the host from queueing work ahead, as training does."""
    profile = measure(job, Context(0, 1, 0, torch.device("cpu")), per_device_batch=16)
    assert len(synchronizes) == profile["warmup_steps"] + 2 * profile["steps"] * len(profile["attempts_interference"])
    assert profile["median"]["sync_s"] == 0.0
    assert all(profile["median"][part] > 0 for part in ("data_s", "compute_s", "update_s", "step_s"))


def test_a_disturbed_measurement_is_repeated_and_the_quietest_attempt_kept(job, monkeypatch):
    monkeypatch.setattr(profiling, "BACKOFF_S", 0.0)
    job["search"].update(max_attempts=2, interference_tolerance=0.0)  # nothing is quiet enough: both attempts run
    profile = measure(job, Context(0, 1, 0, torch.device("cpu")), per_device_batch=8)
    attempts = profile["attempts_interference"]
    assert len(attempts) == 2 or attempts[0] == 0.0
    assert profile["interference"] == min(attempts) and 0.0 <= profile["interference"] <= 1.0


@pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0, reason="needs root and unshare(1)")
def test_ranks_under_another_hostname_on_this_machine_count_as_the_same_machine():
    """Slurm nodes in namespaces of one host have their own hostnames but share its CPUs: the profiler must
    not count a fellow rank's CPU time as other users' work."""
    probe = [sys.executable, "-c", "from tula_hpc.profiling import _machine_id; print(_machine_id())"]
    renamed = subprocess.run(
        ["unshare", "--uts", "sh", "-c", 'hostname tula-test-node && exec "$@"', "sh", *probe],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert renamed == profiling._machine_id() != ""


def _burn_cpu(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_cpu_of_processes_the_rank_started_is_its_own_not_interference():
    """DataLoader workers are the job's work: a child that burns CPU counts as the rank's own seconds, whether it
    still runs when read or has ended and been waited for."""
    context = multiprocessing.get_context("spawn")
    before = profiling._own_cpu_s()
    child = context.Process(target=_burn_cpu, args=(0.6,))
    child.start()
    child.join()
    assert profiling._own_cpu_s() - before >= 0.5


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

    monkeypatch.setattr(profiling.dist, "all_reduce", all_reduce_of_two_equal_ranks)
    profiling._all_reduce_gradients(model, world_size=2, cap_bytes=2048)
    assert all(in_place or size <= 2048 for in_place, size in reduced)
    assert any(in_place for in_place, _ in reduced) and any(not in_place for in_place, _ in reduced)
    assert sum(size for _, size in reduced) == sum(g.numel() * 4 for g in grads.values())
    for p in model.parameters():
        assert torch.equal(p.grad, grads[p.grad.data_ptr()])
    assert profiling.BUCKET_CAP_BYTES == 25 * 2**20  # DDP's default bucket_cap_mb


def _all_reduce_in_buckets(rank: int, outdir: str) -> None:
    model = _model_with_gradients(rank)
    profiling._all_reduce_gradients(model, world_size=2, cap_bytes=2048)
    torch.save([p.grad for p in model.parameters()], f"{outdir}/rank{rank}.pt")


def test_two_ranks_end_with_the_mean_of_their_gradients(tmp_path):
    run_on_two_ranks(_all_reduce_in_buckets, str(tmp_path))
    expected = [
        (a.grad + b.grad) / 2
        for a, b in zip(_model_with_gradients(0).parameters(), _model_with_gradients(1).parameters())
    ]
    for rank in (0, 1):
        for got, want in zip(torch.load(tmp_path / f"rank{rank}.pt"), expected):
            torch.testing.assert_close(got, want)


class _RankEnded(Exception):
    """os._exit, as end_job_step ends the rank, without ending pytest."""


@pytest.mark.parametrize(
    "error",
    [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), RuntimeError("CUDA out of memory.")],
)
def test_a_profile_that_runs_out_of_memory_is_a_clear_stage_error(job, tmp_path, monkeypatch, error):
    """The failing rank records it and ends the job step; the stage names the job, the configuration, the memory
    model's largest batch and what to do, however the backend ended the other ranks."""

    def measure_out_of_memory(*args, **kwargs):
        raise error

    def end_rank(code):
        raise _RankEnded(code)

    def run_one_rank(fn, kwargs, spec, folder, name):
        with pytest.raises(_RankEnded):
            fn(**kwargs)
        raise profiling.launch.JobFailed(f"{name}: a rank exited with code 3")

    monkeypatch.setattr(profiling, "measure", measure_out_of_memory)
    monkeypatch.setattr(os, "_exit", end_rank)
    monkeypatch.setattr(profiling.launch, "run", run_one_rank)
    plan = tmp_path / "plan.json"
    plan.write_text('{"profile": [{"nodes": 1, "batch": 64}], "max_batch_per_device": 48}')
    with pytest.raises(StageError) as failure:
        profiling.profile(job, plan, 1, 64, tmp_path / "N1_B64.json", tmp_path / "work")
    message = str(failure.value)
    assert "job 'digits-cnn': the profile at nodes=1, global batch 64 (64 per device) ran out of memory" in message
    assert "allows up to 48 per device" in message and "out of memory" in message.split("Error: ")[1]
    assert all(advice in message for advice in ("probe_memory", "resources.memory_headroom", "search.batch.max"))
    assert not (tmp_path / "N1_B64.json").exists()


def test_a_profile_that_fails_otherwise_is_not_taken_for_running_out_of_memory(job, tmp_path, monkeypatch):
    def run_failing(fn, kwargs, spec, folder, name):
        raise profiling.launch.JobFailed(f"{name}: node lost")

    monkeypatch.setattr(profiling.launch, "run", run_failing)
    plan = tmp_path / "plan.json"
    plan.write_text('{"profile": [{"nodes": 1, "batch": 64}], "max_batch_per_device": 48}')
    with pytest.raises(profiling.launch.JobFailed, match="node lost"):
        profiling.profile(job, plan, 1, 64, tmp_path / "N1_B64.json", tmp_path / "work")


@pytest.fixture
def gpu_job(job):
    """The default job on Slurm nodes of 4 GPUs, each candidate choosing how many of them to use."""
    job["launcher"], job["resources"]["gpus_per_node"] = "slurm", 4
    return job


@pytest.fixture
def launched(monkeypatch):
    """Profile jobs as launched (spec, folder, name), each returning a record of the ranks it ran."""
    runs = []

    def run(fn, kwargs, spec, folder, name):
        runs.append((spec, folder, name))
        return {"world_size": spec.world_size, "global_batch": kwargs["global_batch"]}, None

    monkeypatch.setattr(profiling.launch, "run_or_out_of_memory", run)
    return runs


def _plan(path, candidates):
    path.write_text(json.dumps({"candidates": candidates, "profile": candidates[:1], "max_batch_per_device": 64}))
    return path


def test_a_profile_at_other_gpus_per_node_launches_that_many_ranks_and_records_them(gpu_job, launched, tmp_path):
    plan = _plan(tmp_path / "plan.json", [{"nodes": 2, "gpus_per_node": 2, "batch": 64}])
    config = tmp_path / "jobs.yaml"
    config.write_text(yaml.safe_dump(job_config(resources={"gpus_per_node": 4, "mem_gb": 16})))
    out = tmp_path / "N2_G2_B64.json"
    argv = ["--config", str(config), "--job", "digits-cnn", "--launcher", "slurm", "--work-dir", str(tmp_path)]
    argv += ["--plan", str(plan), "--nodes", "2", "--gpus-per-node", "2", "--batch", "64", "--out", str(out)]
    assert profiling.main(argv) == 0
    [(spec, folder, name)] = launched
    assert (spec.nodes, spec.tasks_per_node, spec.world_size) == (2, 2, 4)
    assert folder.name == "N2_G2_B64" and name == "digits-cnn-profile-N2-G2-B64"
    assert json.loads(out.read_text())["gpus_per_node"] == 2
    with pytest.raises(StageError, match=r"\(nodes=2, gpus_per_node=4, batch=64\) is not in the plan"):
        profiling.profile(gpu_job, plan, 2, 64, tmp_path / "N2_B64.json", tmp_path / "work")


def test_adaptive_search_keeps_each_node_shape_under_its_own_name(gpu_job, launched, tmp_path, monkeypatch):
    candidates = [{"nodes": 2, "gpus_per_node": g, "batch": 64, "per_device_batch": 64 // (2 * g)} for g in (4, 2)]
    plan = _plan(tmp_path / "plan.json", candidates)
    planned = tmp_path / "N2_B64.json"
    planned.write_text(json.dumps({"nodes": 2, "gpus_per_node": 4, "global_batch": 64, "world_size": 8}))

    def search(grid, initial, measure, row_of, *settings):
        profiles = [measure(c) for c in grid]
        assert [row_of(c) for c in grid] == [[8, 8, 4], [4, 16, 2]]
        return {"profiled": grid, "profiles": profiles, "history": [], "discrepancy_per_octave": 0.02, "stopped": "-"}

    monkeypatch.setattr(profiling, "adaptive_search", search)
    manifest = profiling.adapt(gpu_job, plan, [planned], tmp_path / "adaptive.json", tmp_path / "work")
    assert [(spec.nodes, spec.tasks_per_node) for spec, _, _ in launched] == [(2, 2)]  # the planned one is read
    assert (tmp_path / "work" / "adaptive" / "N2_G2_B64.json").exists()
    assert [record["gpus_per_node"] for record in manifest["added"]] == [2]

"""What a profile job runs on its nodes: a few real DDP training steps at one per-device batch, timed part by part
(the profile and adapt stages only submit it, profile_jobs.py, and write what it returns).

Steps are the job's own training step (training/step.py, with its strategy) and come in pairs. The first of
a pair splits the work into data loading, forward+backward without gradient sync, an explicit
all-reduce of the gradients (in DDP's bucket size) and the strategy's update, so the performance model can fit
compute and sync separately. The second is the step as training runs it (sync overlapped with
backward): its time is the step time training will see. Per-step times are the maximum
over ranks; the profile keeps medians, which one slow step does not move.

Kernels run asynchronously on a GPU: host clocks around the calls that launch them would time the launches. A
`Clock` marks the phase boundaries and reads the times once the work is done. On CUDA its marks are events recorded
on the current stream, stamped by the GPU when its work reaches them. The measured pairs run back to back, as
training's steps do (it never waits for the device within an epoch), and their marks are read after one synchronize
at the end of the block: a synchronize at every boundary would keep the host from queueing the next phase while the
GPU runs this one, and one at every step's end starts each step on an idle GPU that waits for the host's loading and
first launches, which training hides behind the previous step. (On the H200, at launch-bound sizes, back-to-back
steps were within the round-to-round noise of steps synchronized one by one, and both above the trained epochs'
steps: bench/data/gpu/README.md.) So a mark is reached when the GPU is done with the work queued before it, and a
part is the time the GPU spent on it or waited for it: the data phase (the loader, then the non-blocking copy) holds
the loading the previous step's work did not hide, as in training. The parts, between consecutive marks, add up to
the step. Before the barrier ahead of the timed all-reduce the host also waits for its GPU (the barrier is gloo's,
on the host), so that stragglers wait there, outside every part. On the CPU the marks are `perf_counter` readings.
The warm-up's steps and the epoch ends' are timed one by one, each on an idle device: they hold first-time costs.

Shared machines are noisy (the same step measured in separate processes here varies by 10-15 %, and by
2x while another job runs), so the measurement defends itself:
- short steps are measured for at least `min_measure_s` seconds (many cheap samples); long steps stop
  after `steps` pairs (their own length averages the jitter out);
- it records how much other work disturbed it (`Interference`) and, above `interference_tolerance`,
  backs off and measures again, up to `max_attempts` times, keeping the quietest attempt; the fit then
  weighs each profile by how quiet it was.

What happens once per run and once per epoch is timed too (performance/run_overhead.py turns it into the warm-up W and
the epoch-end terms): the warm-up steps are kept one by one (`warmup_step_s`; on a GPU the first step of a process
builds cuDNN and cuBLAS plans and fills the allocator's cache: 945 ms against 24 ms steady for resnet18 at b=512
on the H200, bench/data/gpu), and two epoch ends are run as training runs them (`epoch_ends`): the epoch's last,
shorter step, the strategy's epoch end, the loader's restart and the next epoch's first step (AGS's split-batch
update step). The first holds the shapes' first-time costs, the second the steady ones. Validation (on at most
VALIDATION_BATCHES batches per rank, scaled to the whole split) and a checkpoint write are timed after them. All of this
runs between the warm-up and the measured steps, so that those are a steady epoch's steps: AGS scales every step by its
factors from the second epoch on, a kernel-launch cost the first epoch never pays (bench/data/gpu/whole_run).

The measured steps draw on batches the loader's workers made ahead while the epoch ends were timed, so they cannot show
a loader slower than the step. After them the loader alone is timed (`loader_period_s`: batches of a fresh epoch one
after another, nothing else asked of the host): the pace that performance/loader_rate.py holds a whole epoch's steps to.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import re
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import psutil
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Subset

from tula_hpc.cluster.distributed import Context, init_distributed, shutdown
from tula_hpc.cluster.job_step_failures import out_of_memory_ends_job_step
from tula_hpc.core.run_layout import last_batch, steps_per_epoch
from tula_hpc.training.checkpoint import rng_state, save_checkpoint
from tula_hpc.training.loaders import loader_options, make_loader, on_device, start_epoch
from tula_hpc.training.preemption import StopRequests
from tula_hpc.training.progress import tokens_per_sample
from tula_hpc.training.step import (
    accumulate_gradients,
    apply_update,
    build_for_job,
    clock_for,
    evaluate_metrics,
    loop_step,
    wrap_ddp,
)
from tula_hpc.training.strategies import build_strategy
from tula_hpc.training.tasks import job_task, select

if TYPE_CHECKING:
    from tula_hpc.core.job import Job, SearchSettings

PARTS = ("data_s", "compute_s", "sync_s", "update_s", "step_s")
MAX_STEPS = 200
BACKOFF_S = 1.0
BUCKET_CAP_BYTES = 25 * 1024 * 1024  # DDP's default bucket_cap_mb (25): the timed all-reduce's buckets are DDP's size
EPOCH_ENDS = 2  # the first holds the first-time costs of the epoch end's shapes, the second the steady ones
VALIDATION_BATCHES = 4  # per rank: validation is forward passes over equal batches, linear in the samples


def _batches(loader, first_epoch: int = 0):
    for epoch in itertools.count(first_epoch):
        start_epoch(loader, epoch)
        yield from loader


def _buckets(grads: list[torch.Tensor], cap_bytes: int) -> list[list[torch.Tensor]]:
    """Consecutive gradients in groups of at most `cap_bytes` together; a larger gradient is a group alone."""
    buckets: list[list[torch.Tensor]] = []
    size = cap_bytes  # the first gradient opens a bucket
    for grad in grads:
        nbytes = grad.numel() * grad.element_size()
        if size + nbytes > cap_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(grad)
        size += nbytes
    return buckets


def _all_reduce_gradients(model: nn.Module, world_size: int, cap_bytes: int = BUCKET_CAP_BYTES) -> None:
    """Average the gradients over the ranks, one all-reduce per bucket as DDP's: each bucket's gradients are
    copied into one flat tensor of at most `cap_bytes` (a gradient alone in its bucket is reduced in place), so
    the profile never holds a second copy of all gradients on the device, which training does not."""
    for bucket in _buckets([p.grad for p in model.parameters() if p.grad is not None], cap_bytes):
        flat = bucket[0] if len(bucket) == 1 else torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat)
        flat /= world_size
        if len(bucket) > 1:
            for grad, part in zip(bucket, flat.split([g.numel() for g in bucket])):
                grad.copy_(part.view_as(grad))


def _peak_rss_bytes() -> int:
    return int(re.search(r"VmHWM:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) * 1024


def _thread_run_delay_s() -> float:
    """Time the calling thread has spent runnable but waiting for a CPU (Linux schedstat; 0 elsewhere)."""
    try:
        return int(Path("/proc/thread-self/schedstat").read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def _machine_id() -> str:
    """Which physical machine this is. Not the hostname: Slurm nodes in namespaces of one host have their own
    names but share its CPUs and /proc/stat, and so share a boot id."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return socket.gethostname()


def _host_busy_s() -> float:
    """CPU seconds every process on this host has used since boot (hypervisor steal counts as busy)."""
    try:
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, Path("/proc/stat").read_text().split()[1:9])
    except (OSError, ValueError):
        return 0.0
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    """CPU seconds this rank's process tree has used: the process, the DataLoader workers and anything else it
    started (live ones read from /proc, ended ones from the kernel's count of waited-for children)."""
    me = psutil.Process()
    total = 0.0
    for proc in [me, *me.children(recursive=True)]:
        try:
            times = proc.cpu_times()
        except psutil.Error:  # ended meanwhile: counted with the waited-for children once reaped
            continue
        total += times.user + times.system
    ended = os.times()
    return total + ended.children_user + ended.children_system


class Interference:
    """How much other work disturbed a measurement: on a shared machine it can double a step time.

    Two views, the larger counts: the share of the measured steps the training thread spent waiting for
    a CPU (someone runs on our cores), and the share of the host's CPUs that processes outside this
    profile's ranks and the processes they started (DataLoader workers) used meanwhile (they compete for
    caches and memory bandwidth even on other cores).
    """

    def __init__(self, ctx: Context):
        self.ctx = ctx
        self.started = (time.perf_counter(), _host_busy_s(), _own_cpu_s())
        self.waited = self.busy = 0.0

    def around(self, step):
        """Run `step()`, counting how long the training thread waited for a CPU meanwhile."""
        before, t0 = _thread_run_delay_s(), time.perf_counter()
        result = step()
        self.waited += _thread_run_delay_s() - before
        self.busy += time.perf_counter() - t0
        return result

    def share(self) -> float:
        wall = time.perf_counter() - self.started[0]
        mine = (
            _machine_id(),
            _host_busy_s() - self.started[1],
            _own_cpu_s() - self.started[2],
            self.waited / max(self.busy, 1e-9),
        )
        everyone = [mine]
        if self.ctx.world_size > 1:
            everyone = [None] * self.ctx.world_size
            dist.all_gather_object(everyone, mine)
        hosts = {host for host, *_ in everyone}
        foreign = max(
            max(busy for host, busy, _, _ in everyone if host == h)
            - sum(own for host, _, own, _ in everyone if host == h)
            for h in hosts
        )
        return max(foreign / (wall * os.cpu_count()), max(wait for *_, wait in everyone), 0.0)


def _max_over_ranks(values: list[float], ctx: Context) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64, device=ctx.device)
    if ctx.world_size > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def _summary(values: list[float]) -> tuple[float, float]:
    """Median and interquartile range over the median (0 when there is nothing to spread)."""
    median = statistics.median(values)
    if median <= 0 or len(values) < 2:
        return median, 0.0
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return median, (q3 - q1) / median


def _profile_loader(job: Job, ctx: Context, splits, per_device_batch: int):
    """The training loader as the train stage builds it (full batches only: every timed step is one of them)."""
    return make_loader(
        splits.train,
        per_device_batch,
        rank=ctx.rank,
        world_size=ctx.world_size,
        seed=job.train.seed,
        shuffle=True,
        drop_last=True,
        **loader_options(job, ctx.device),
    )


def _measured_attempts(search: SearchSettings, runner: StepRunner, pairs: int) -> list[tuple[list[list[float]], float]]:
    """Blocks of `pairs` step pairs, each with how much other work disturbed it (see Interference), measured
    again after a back-off while that share exceeds search.interference_tolerance, search.max_attempts at most.
    A block runs back to back as training's steps do, its times read once at its end (its first pair starts on an
    idle device, one pair of many that the medians hold)."""
    attempts = []
    for attempt in range(search.max_attempts):
        time.sleep(BACKOFF_S * attempt)  # let another user's burst pass before measuring again
        interference = Interference(runner.ctx)
        spans = [interference.around(runner.split_step) + [runner.full_step_span()] for _ in range(pairs)]
        flat = runner.clock.seconds(list(itertools.chain(*spans)))
        rows = [flat[i : i + len(PARTS)] for i in range(0, len(flat), len(PARTS))]
        attempts.append((rows, interference.share()))
        if attempts[-1][1] <= search.interference_tolerance:
            break
    return attempts


class StepRunner:
    """The steps a profile times, on one rank: the split step, the training loop's step, and an epoch's end."""

    def __init__(self, job: Job, ctx: Context, per_device_batch: int):
        self.job, self.ctx, self.per_device_batch = job, ctx, per_device_batch
        self.splits, self.model = build_for_job(job, ctx)
        self.net = wrap_ddp(self.model, ctx)
        # The job's own strategy and step (training/step.py): AGS's reference gradients, LARS's norms and PoLo's
        # hook cost what they cost in training, so the model fitted to these times predicts training.
        self.strategy = build_strategy(
            self.net,
            job.train,
            per_device_batch * ctx.world_size,
            steps_per_epoch(len(self.splits.train), ctx.world_size, per_device_batch),
            len(self.splits.train),
            tokens_per_sample=tokens_per_sample(job.data),  # the noise scale in tokens too, for sequences
        )
        self.task = job_task(job)
        self.loader = _profile_loader(job, ctx, self.splits, per_device_batch)
        self.batches = _batches(self.loader)
        self.clock = clock_for(ctx.device)
        self.stop = StopRequests(ctx.world_size)  # its flag exchange only: signals are the profile job's own concern

    def split_step(self) -> list[tuple]:
        """The training step with its parts apart, as the clock's spans to read later: sync is an explicit
        all-reduce after the backward."""
        ctx, clock, net = self.ctx, self.clock, self.net
        start = clock.mark()
        batch = on_device(next(self.batches), ctx.device)
        loaded = clock.mark()
        _, reference_grads = accumulate_gradients(net, self.strategy, self.task, batch, sync=False)
        computed = sync_start = synced = clock.mark()
        if ctx.world_size > 1:
            clock.wait()  # the barrier is the host's: this rank's GPU must be done too
            dist.barrier()  # stragglers wait here, not inside the timed all-reduce
            sync_start = clock.mark()
            _all_reduce_gradients(self.model, ctx.world_size)
            synced = clock.mark()
        apply_update(net, self.strategy, self.task, batch, reference_grads)
        return [(start, loaded), (loaded, computed), (sync_start, synced), (synced, clock.mark())]

    def full_step_span(self, batch=None) -> tuple:
        """The training loop's step (sync overlapped with backward, the stop-flag exchange beside it), on the
        loader's next batch or on `batch`, as the clock's span to read later."""
        start = self.clock.mark()
        batch = next(self.batches) if batch is None else batch
        loop_step(self.net, self.strategy, self.task, batch, self.ctx.device, self.stop)
        return start, self.clock.mark()

    def full_step(self, batch=None) -> float:
        """`full_step_span` alone on the device: a warm-up's or an epoch end's step, each with its own first-time
        costs."""
        return self.clock.seconds([self.full_step_span(batch)])[0]

    def _host_seconds(self, work) -> float:
        """Host seconds of `work()` with the device done before and after."""
        self.clock.wait()
        started = time.perf_counter()
        work()
        self.clock.wait()
        return time.perf_counter() - started

    def _reopened(self, epoch: int, samples_done: int = 0):
        """A new iterator over `epoch` from `samples_done` on, the open one closed. Made here rather than on first
        use: closing an iterator mid-epoch leaves the batches it asked for in the workers' hands, and a persistent
        loader's next iterator waits for them as it is made (up to two worker batches with a slow loader), time that
        belongs to no epoch start and to no batch."""
        self.batches.close()
        start_epoch(self.loader, epoch, samples_done)
        return iter(self.loader)

    def _epochs_last_batch(self, epoch: int):
        """`epoch` laid out from its last full batch on, that batch, and the loader's iterator run out: the epoch
        ends as training's does, with no batch asked of the workers (which training's epoch start never waits for)."""
        full = self.loader.sampler.num_samples // self.per_device_batch  # the rank's full batches in an epoch
        batches = self._reopened(epoch, max(full - 1, 0) * self.per_device_batch)
        batch = next(batches)
        for _ in batches:  # none left
            pass
        return batch

    def epoch_end(self, epoch: int) -> list[float]:
        """An epoch's end as training runs it: [the last, shorter step, the strategy's epoch end (outside the
        epoch's time), the loader's restart and the next epoch's first step (inside it)]."""
        batch = on_device(self._epochs_last_batch(epoch - 1), self.ctx.device)
        last = last_batch(len(self.splits.train), self.ctx.world_size, self.per_device_batch)
        last_s = self.full_step(select(batch, torch.arange(last)))
        end_s = self._host_seconds(self.strategy.end_epoch)
        started = time.perf_counter()  # the device is done (end_s waited for it)
        self.batches = _batches(self.loader, epoch)
        first = next(self.batches)
        restart_s = time.perf_counter() - started
        return [last_s, end_s, restart_s + self.full_step(first)]

    def loader_period_s(self) -> float | None:
        """Seconds between batches of the loader's workers at their own pace, the host asking for nothing else: the
        first prefetch_factor (2) x workers batches of a fresh epoch (what the workers are asked for at its start) over
        their number, the pace performance/loader_rate.py holds the steps to. None without workers, where loading is
        the step's data part. Run after the measured steps, whose batches the workers had made ahead."""
        loader = self.loader
        if loader.num_workers == 0:
            return None
        batches = self._reopened(0)
        count = min(loader.prefetch_factor * loader.num_workers, len(loader))  # the batches asked for at first
        started = time.perf_counter()
        for _ in range(count):
            next(batches)
        period = (time.perf_counter() - started) / count
        del batches
        self.batches = _batches(self.loader)
        return period

    def validation_s(self) -> float:
        """Validation as training's epoch end runs it (`evaluate_metrics` at its batch and precision), on at most
        VALIDATION_BATCHES batches per rank, scaled to the whole validation split."""
        val = self.splits.val
        share = Subset(val, range(min(len(val), VALIDATION_BATCHES * self.per_device_batch * self.ctx.world_size)))
        if not len(share):
            return 0.0
        options = loader_options(self.job, self.ctx.device)
        score = functools.partial(
            evaluate_metrics,
            self.net,
            share,
            self.ctx,
            self.task,
            self.per_device_batch,
            self.strategy.precision,
            **options,
        )
        return self._host_seconds(score) * len(val) / len(share)

    def checkpoint_s(self, folder: str | None) -> float:
        """Rank 0's checkpoint write as training's (model, optimiser, RNG states; training's other ranks wait for
        it), into a temporary folder under `folder` (the job's work folder: the file system training writes to)."""
        if not self.ctx.is_main:
            return 0.0
        if folder is not None:
            Path(folder).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder) as scratch:
            checkpoint = {
                "model": self.model.state_dict(),
                "optimizer": self.strategy.optimizer.state_dict(),
                "rng": [rng_state()] * self.ctx.world_size,
            }
            return self._host_seconds(lambda: save_checkpoint(Path(scratch) / "checkpoint.pt", checkpoint))

    def epoch_ends(self, checkpoint_dir: str | None) -> dict:
        """EPOCH_ENDS epoch ends, then validation twice (the first builds its shapes) and a checkpoint, each the
        maximum over ranks: performance/run_overhead.py's inputs."""
        ends = [self.epoch_end(epoch) for epoch in range(1, EPOCH_ENDS + 1)]
        timed = _max_over_ranks([*itertools.chain(*ends), *[self.validation_s() for _ in range(2)]], self.ctx)
        timed += _max_over_ranks([self.checkpoint_s(checkpoint_dir)], self.ctx)
        columns = [timed[i : 3 * EPOCH_ENDS : 3] for i in range(3)]
        return {
            "last_step_s": columns[0],
            "strategy_end_s": columns[1],
            "start_s": columns[2],
            "validation_s": timed[3 * EPOCH_ENDS : 3 * EPOCH_ENDS + 2],
            "checkpoint_s": timed[-1],
            "last_batch": last_batch(len(self.splits.train), self.ctx.world_size, self.per_device_batch),
            "val_samples": len(self.splits.val),
        }


def measure(job: Job, ctx: Context, per_device_batch: int, checkpoint_dir: str | None = None) -> dict | None:
    """Time training steps at `per_device_batch` on the ranks of `ctx`, then its warm-up and epoch ends (see the
    module's docstring); rank 0 returns the profile. `checkpoint_dir`: where the timed checkpoint is written
    (default: the system's temporary folder)."""
    started = time.perf_counter()
    search = job.search
    runner = StepRunner(job, ctx, per_device_batch)
    warmup = _max_over_ranks([runner.full_step() for _ in range(max(1, search.warmup_steps))], ctx)
    # The strategy's epoch end runs collectives on the default group: a measurement on some of its ranks (a bench's
    # one-rank configuration beside an idle rank) cannot run it. Run before the measured steps, the epoch ends leave
    # the strategy as training's steady epochs have it (AGS scaling by its factors from the second epoch on).
    whole_group = not dist.is_initialized() or dist.get_world_size() == ctx.world_size
    epoch_ends = runner.epoch_ends(checkpoint_dir) if whole_group else None
    # Every rank must run the same number of steps: agree on it from the slowest rank's warm-up.
    pair_s = 2 * max(statistics.median(warmup), 1e-6)
    pairs = min(MAX_STEPS, max(search.steps, math.ceil(search.min_measure_s / pair_s)))
    attempts = _measured_attempts(search, runner, pairs)
    rows, interference = min(attempts, key=lambda attempt: attempt[1])
    columns = list(zip(*[_max_over_ranks(row, ctx) for row in rows]))
    period = runner.loader_period_s()
    loader = (
        None
        if period is None
        else {"workers": runner.loader.num_workers, "period_s": _max_over_ranks([period], ctx)[0]}
    )
    peak = _max_over_ranks([_peak_rss_bytes()], ctx)[0]
    strategy = runner.strategy
    noise_scale = strategy.noise_scale.read() if strategy.noise_scale is not None else None
    if not ctx.is_main:
        return None
    per_step = {part: list(values) for part, values in zip(PARTS, columns)}
    stats = {part: _summary(values) for part, values in per_step.items()}
    median = {part: m for part, (m, _) in stats.items()}
    return {
        "world_size": ctx.world_size,
        "per_device_batch": per_device_batch,
        "global_batch": per_device_batch * ctx.world_size,
        "warmup_steps": len(warmup),
        "warmup_step_s": warmup,  # the first steps of the process, one by one (the slowest rank's)
        "steps": pairs,
        "median": median,
        "iqr_over_median": {part: s for part, (_, s) in stats.items()},
        "per_step": per_step,
        "epoch_ends": epoch_ends,
        "loader": loader,  # its workers' pace (performance/loader_rate.py); None without workers
        "samples_per_s": per_device_batch * ctx.world_size / median["step_s"],
        "peak_rss_bytes": int(peak),
        "grad_bytes": sum(p.numel() * p.element_size() for p in runner.model.parameters() if p.requires_grad),
        "measure_wall_s": time.perf_counter() - started,
        "interference": interference,
        "attempts_interference": [share for _, share in attempts],
        # B_noise of the overlapped steps' gradients (training/noise_scale.py); None on one rank
        "noise_scale": noise_scale,
    }


def profile_worker(
    job: Job, global_batch: int, failure_dir: str | None = None, checkpoint_dir: str | None = None
) -> dict | None:
    """`measure` on every rank; a rank that runs out of memory records it in `failure_dir` and ends the job step."""
    ctx = init_distributed(job.resources.gpus_per_node > 0)
    try:
        with out_of_memory_ends_job_step(failure_dir):
            return measure(job, ctx, global_batch // ctx.world_size, checkpoint_dir)
    finally:
        shutdown()

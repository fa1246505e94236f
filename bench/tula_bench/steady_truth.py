"""Ground truth for the memory benchmarks: the device's peak over steady training, measured apart from the model.

The memory model (profiling/memory_summary.py) is built from phase-by-phase peaks of probe steps it runs itself. The
truth here shares none of that path: the training loop's own step (`training_step.training_step`) on batches
from a DataLoader (sampled with replacement, so a batch may exceed the digits set), STEPS_PER_EPOCH steps
per epoch for EPOCHS epochs with the strategy's epoch end between them (so AGS runs its update step each
epoch), and the device's high-water mark over every step after the first (which builds the optimiser
state): the budget allocator's count on the CPU, the CUDA allocator's on a GPU. Each measurement runs in
a fresh process, as a trial of the probe stage does. Under a budget, running out of memory answers
"does not fit".

Run one:  .venv/bin/python bench/steady_truth.py '{"job": {...}, "batch": 256, "budget": null}'
          .venv/bin/python bench/steady_truth.py --smoke --out FILE   (the smallest case, tiny_cnn at 8x8 and batch 4,
          through `measure` as the memory benchmarks call it; its answer written with provenance: CI's check)
"""

from __future__ import annotations

import json
import subprocess
import sys

from tula_bench.common import BENCH, bench_job, bench_parser, parse_bench_args, write_result
from tula_hpc.core.job import Job

STEPS_PER_EPOCH = 2
EPOCHS = 3
SMOKE_BATCH = 4


def steady_peak(job: Job, batch: int, budget: int | None) -> dict:
    """The peak over the steady steps of a short training run at per-device batch `batch`."""
    import torch
    from torch.utils.data import DataLoader, RandomSampler

    from tula_hpc.cluster.devices import is_out_of_memory
    from tula_hpc.cluster.distributed import Context
    from tula_hpc.memory.device_budget import budget_bytes, device_memory, model_bytes
    from tula_hpc.memory.step_parts import PEAK
    from tula_hpc.training.loaders import collate, on_device
    from tula_hpc.training.step import build_for_job, training_step
    from tula_hpc.training.strategies import build_strategy
    from tula_hpc.training.tasks import job_task

    torch.set_num_threads(job.resources.cpus_per_task)
    use_gpu = job.resources.gpus_per_node > 0 and torch.cuda.is_available()
    device = torch.device("cuda", 0) if use_gpu else torch.device("cpu")
    splits, model = build_for_job(job, Context(0, 1, 0, device))
    device_memory.limit(device, budget or budget_bytes(job, device), model_bytes(model), job)
    strategy = build_strategy(model, job.train, batch, STEPS_PER_EPOCH)
    task = job_task(job)
    sampler = RandomSampler(splits.train, replacement=True, num_samples=batch * STEPS_PER_EPOCH)
    loader = DataLoader(splits.train, batch_size=batch, sampler=sampler, collate_fn=collate)
    steps = 0
    try:
        for _ in range(EPOCHS):
            for samples in loader:  # not `batch`: the result names the batch size
                training_step(model, strategy, task, on_device(samples, device))
                steps += 1
                if steps == 1:
                    device_memory.reset_peak(device)
            strategy.end_epoch()
    except Exception as err:
        if not is_out_of_memory(err):
            raise
        return {"batch": batch, "fits": False, "steps": steps, "error": str(err)[:300]}
    peaks = {key: device_memory.peak(device, figure) for figure, key in PEAK.items()}
    return {"batch": batch, "fits": True, "steps": steps, **peaks}


def measure(job: Job, batch: int, budget: int | None = None) -> dict:
    """`steady_peak` in a fresh interpreter, the job crossing as its plain settings (its answer is the last line
    it prints)."""
    arguments = {"job": job.as_dict(), "batch": batch, "budget": budget}
    proc = subprocess.run(
        [sys.executable, str(BENCH / "steady_truth.py"), json.dumps(arguments)],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"steady training at batch {batch} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    """The trial `measure` starts (the job and batch as JSON in, the answer as the last line out), or with --smoke
    the smallest case through `measure`, its answer written to --out."""
    parser = bench_parser(__doc__, "steady_truth.json")
    parser.add_argument("trial", nargs="?", help='the trial as JSON: {"job": {...}, "batch": B, "budget": null}')
    parser.add_argument("--smoke", action="store_true", help=f"tiny_cnn at 8x8 and batch {SMOKE_BATCH} (CI's check)")
    args = parse_bench_args(parser, argv)
    if args.smoke == (args.trial is not None):
        parser.error("give either a trial as JSON or --smoke")
    if args.smoke:
        job = bench_job(as_name="bench-tiny_cnn-8", model={"name": "tiny_cnn"}, data={"image_size": 8})
        settings = {"smoke": True, "batch": SMOKE_BATCH, "budget": None, "job": job.as_dict()}
        write_result(args.out, settings, measure(job, SMOKE_BATCH))
        return
    arguments = json.loads(args.trial)
    print(json.dumps(steady_peak(Job.from_dict(arguments.pop("job")), **arguments)))

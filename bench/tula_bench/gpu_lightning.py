"""PyTorch Lightning's BatchSizeFinder on the GPU check's memory cases, beside the probe stage (bench/gpu_memory.py).

What a user would otherwise run to find the largest batch: a LightningModule around the job's own model builder and
optimiser (SGD, the job's momentum and weight decay), fed random batches made on the device as the stage's probes
are (`memory_probes.shaped_batch`), under the job's precision and memory format; BatchSizeFinder in binsearch mode,
margin 0. Lightning 2.6.6 clamps its bisection at 8192 after a failure whatever max_val says, so its answer alone
can mislead: every trial it ran is recorded (batch, steps done, fits or not) by the module's own hooks, with its log.
Lightning is not a dependency of the project: where it cannot be imported this part says so and is skipped.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from tula_hpc.core.job import Job

PRECISION = {"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}


def lightning():
    """Lightning's package (lightning.pytorch or pytorch_lightning), or None."""
    try:
        import lightning.pytorch as pl
    except ImportError:
        try:
            import pytorch_lightning as pl
        except ImportError:
            return None
    return pl


class _Found(Exception):
    """Raised once the search has its answer: the fit that would follow it is not the search's time."""


def lightning_module(pl, job: Job, settings: dict, trials: list[dict]):
    """The job's model, loss and optimiser as a LightningModule whose batches are made on its device, limited to the
    job's budget as the stage's trials are; its hooks append each trial (a new run of the loop from its first batch)
    and count the steps it finished."""
    import torch
    from torch.utils._pytree import tree_map
    from torch.utils.data import DataLoader

    from tula_hpc.memory.device_budget import budget_bytes, device_memory, model_bytes
    from tula_hpc.profiling.memory_probes import build_probe_setup, probe_device, shaped_batch

    splits, model, task = build_probe_setup(job)
    device = probe_device(job)
    device_memory.limit(device, budget_bytes(job, device), model_bytes(model), job)  # the truth's budget
    train = job.train
    layout = torch.channels_last if train.channels_last else torch.contiguous_format

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net, self.batch_size = model, settings["init_val"]

        def train_dataloader(self):  # each item a batch's size: the batch itself is made on the device
            return DataLoader(_Sizes(self.batch_size), batch_size=None)

        def training_step(self, size, index):
            example = shaped_batch(splits, task, int(size), self.device)
            inputs = tree_map(lambda t: t.contiguous(memory_format=layout) if t.ndim == 4 else t, example)
            return task.loss_of(self.net, inputs)[0]

        def configure_optimizers(self):
            return torch.optim.SGD(
                self.parameters(), lr=train.lr, momentum=train.momentum, weight_decay=train.weight_decay
            )

        def on_train_batch_start(self, size, index):
            if index == 0:
                trials.append({"batch": int(size), "steps": 0})

        def on_train_batch_end(self, outputs, size, index):
            trials[-1]["steps"] += 1

    return Module()


def search(job: Job, settings: dict, folder: Path) -> dict:
    """BatchSizeFinder's answer for `job`'s model and precision on its device, every trial and the wall time
    (`folder`: where Lightning keeps the model while it searches)."""
    pl = lightning()
    if pl is None:
        return {"skipped": "PyTorch Lightning is not importable here"}
    from tula_hpc.memory.device_budget import device_memory
    from tula_hpc.profiling.memory_probes import probe_device

    class Finder(pl.callbacks.BatchSizeFinder):
        def on_fit_start(self, trainer, module):
            super().on_fit_start(trainer, module)
            raise _Found

    precision, trials, log = PRECISION[job.train.precision], [], _Log()
    finder = Finder(mode="binsearch", margin=0.0, **settings)
    trainer = pl.Trainer(
        accelerator="gpu" if probe_device(job).type == "cuda" else "cpu",
        devices=1,
        precision=precision,
        max_epochs=1,
        callbacks=[finder],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=folder,
    )
    started, error = time.perf_counter(), None
    with log.attached(pl.__name__):
        try:
            trainer.fit(lightning_module(pl, job, settings, trials))
        except _Found:
            pass
        except Exception as err:  # e.g. cuBLAS failing to allocate, which Lightning does not take for OOM
            error = f"{type(err).__name__}: {str(err)[:600]}"
        finally:
            device_memory.lift()
    seconds = time.perf_counter() - started
    for trial in trials:
        trial["outcome"] = "fits" if trial["steps"] >= settings["steps_per_trial"] else "out_of_memory"
    return {
        "version": pl.__version__,
        "settings": {"mode": "binsearch", "margin": 0.0, **settings, "precision": precision},
        "answer": None if error else finder.optimal_batch_size,
        "largest_fits": max((t["batch"] for t in trials if t["outcome"] == "fits"), default=None),
        "smallest_fails": min((t["batch"] for t in trials if t["outcome"] != "fits"), default=None),
        "trials": trials,
        "error": error,  # the search ended by an error it did not expect: its trials so far
        "seconds": seconds,
        "log": log.lines,
    }


class _Sizes:
    """A data set as long as Lightning could ask for, whose every item is the batch's size."""

    def __init__(self, size: int):
        self.size = size

    def __len__(self) -> int:
        return 1 << 40

    def __getitem__(self, index: int) -> int:
        return self.size


class _Log(logging.Handler):
    """Lightning's own lines during the search (its tuner says each trial's size and outcome)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def attached(self, name: str):
        import contextlib

        @contextlib.contextmanager
        def attach():
            logger = logging.getLogger(name)
            level, logger.level = logger.level, logging.INFO
            logger.addHandler(self)
            try:
                yield
            finally:
                logger.removeHandler(self)
                logger.setLevel(level)

        return attach()

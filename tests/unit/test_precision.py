"""Mixed precision: autocast and memory format, fp16's loss scale through a checkpoint, local-SGD ranks skipping an
overflowing step together."""

from __future__ import annotations

import io
import math
import os

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tests.conftest import default_job, run_on_two_ranks
from tula_hpc.core.job import TrainSettings
from tula_hpc.training.precision import Precision
from tula_hpc.training.step import training_step
from tula_hpc.training.strategies import build_strategy
from tula_hpc.training.tasks import ImageClassification

IMAGES = ImageClassification()  # cross-entropy on a pair batch (inputs, classes)


def test_bf16_autocasts_the_forward_in_channels_last_and_fp32_leaves_all_as_it_is():
    model, images = nn.Conv2d(3, 2, 1), torch.randn(2, 3, 4, 4)
    bf16, fp32 = Precision("bf16", torch.device("cpu"), channels_last=True), Precision("fp32", torch.device("cpu"))
    with bf16.autocast():
        assert model(bf16.inputs(images)).dtype == torch.bfloat16
    assert bf16.inputs(images).is_contiguous(memory_format=torch.channels_last)
    with fp32.autocast():
        assert model(fp32.inputs(images)).dtype == torch.float32
    assert fp32.inputs(images) is images and fp32.loss_scale() == 1.0 and fp32.scaler is None
    assert bf16.unscale(torch.optim.SGD(model.parameters(), lr=0.1))  # no scaler: always finite, no sync


@pytest.mark.parametrize("name", ["lbt", "lars", "ags"])
def test_the_fp16_loss_scale_survives_a_checkpoint(name):
    cfg = default_job(train={"strategy": name, "precision": "fp16"}).train

    def fresh():
        model = nn.Linear(4, 3)
        return model, build_strategy(model, cfg, global_batch=64, steps_per_epoch=4)

    model, strategy = fresh()
    x, y = torch.randn(64, 4), torch.arange(64) % 3
    training_step(model, strategy, IMAGES, [x.clone().fill_(math.inf), y])  # skipped: the scale halves
    training_step(model, strategy, IMAGES, [x, y])  # taken: one towards growing it again
    saved = strategy.precision.scaler.state_dict()
    assert (saved["scale"], saved["_growth_tracker"]) == (2.0**15, 1)
    buffer = io.BytesIO()
    torch.save(strategy.optimizer.state_dict(), buffer)  # as save_checkpoint writes it
    buffer.seek(0)

    _, resumed = fresh()
    resumed.resume(torch.load(buffer, weights_only=False), step=2)
    assert resumed.precision.scaler.state_dict() == saved
    assert resumed.precision.loss_scale() == 2.0**15


def _polo_fp16_worker(rank: int, train_cfg: TrainSettings, outdir: str) -> None:
    """Local SGD from the first step; only rank 1's gradient overflows."""
    torch.manual_seed(0)
    net = DistributedDataParallel(nn.Linear(4, 3))
    strategy = build_strategy(net, train_cfg, global_batch=32, steps_per_epoch=4)
    x, y = torch.randn(16, 4), torch.arange(16) % 3
    if rank == 1:
        x[0, 0] = math.inf
    before = [p.detach().clone() for p in net.parameters()]
    training_step(net, strategy, IMAGES, [x, y])
    result = {
        "unchanged": all(torch.equal(p, q) for p, q in zip(net.parameters(), before)),
        "scale": strategy.precision.loss_scale(),
        "averager_step": strategy.optimizer.averager.step,
    }
    torch.save(result, os.path.join(outdir, f"rank{rank}.pt"))


@pytest.mark.spawns
def test_fp16_local_sgd_ranks_skip_a_step_together_when_one_overflows(tmp_path):
    """Each local-SGD rank holds its own gradient; a rank stepping alone would leave the model averages unmatched."""
    train = dict(strategy="polo", precision="fp16", polo={"sync_epochs": 0, "averages_per_epoch": 2})
    run_on_two_ranks(_polo_fp16_worker, default_job(train=train).train, str(tmp_path))
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert results == [{"unchanged": True, "scale": 2.0**15, "averager_step": 0}] * 2

"""training/evaluation.py: BatchNorm statistics recomputed on the training set (precise BN), on one rank and two."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset

from tula_hpc.cluster.distributed import Context
from tula_hpc.training.evaluation import PRECISE_BN_SAMPLES, recompute_batchnorm_statistics, scored
from tula_hpc.training.tasks import CausalLM, ImageClassification

IMAGES = ImageClassification()

CPU = Context(0, 1, 0, torch.device("cpu"))


def shifted_data(n: int, seed: int = 0) -> tuple[torch.Tensor, TensorDataset]:
    torch.manual_seed(seed)
    x = torch.randn(n, 3) * torch.tensor([1.0, 2.0, 0.5]) + torch.tensor([5.0, -3.0, 0.25])
    return x, TensorDataset(x, torch.zeros(n, dtype=torch.long))


def stale_norm() -> nn.Module:
    model = nn.Sequential(nn.BatchNorm1d(3, momentum=0.01))
    model[0].running_mean.fill_(100.0)  # what a few steps at momentum 0.01 leave: close to the start, far from the data
    return model


def drawn(n: int, seed: int) -> torch.Tensor:
    """The samples precise BN draws from a set of `n`, in the order it draws them."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:PRECISE_BN_SAMPLES]


def test_precise_bn_replaces_stale_running_statistics_with_the_training_set_average():
    x, data = shifted_data(1000)
    model = stale_norm()
    assert recompute_batchnorm_statistics(model, data, CPU, IMAGES, seed=3, batch_size=100)
    assert torch.allclose(model[0].running_mean, x.mean(0), atol=1e-4)
    # Averaged per batch of 100: the unbiased variance within each batch, not over the whole set.
    per_batch = torch.stack([chunk.var(0) for chunk in x[drawn(1000, 3)].split(100)]).mean(0)
    assert torch.allclose(model[0].running_var, per_batch, rtol=1e-4)
    assert model[0].momentum == 0.01 and model.training  # the model is left as training left it, statistics aside


def test_precise_bn_passes_a_bounded_seeded_sample_of_a_large_set():
    x, data = shifted_data(3 * PRECISE_BN_SAMPLES)
    model = stale_norm()
    recompute_batchnorm_statistics(model, data, CPU, IMAGES, seed=1, batch_size=512)
    assert model[0].num_batches_tracked == PRECISE_BN_SAMPLES // 512
    assert torch.allclose(model[0].running_mean, x[drawn(len(x), 1)].mean(0), atol=1e-4)
    assert not torch.allclose(model[0].running_mean, x.mean(0), atol=1e-4)  # the sample, not the whole set


def _precise_bn_on_a_rank(rank: int, store_path: str, out: str) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    _, data = shifted_data(1000)
    model = stale_norm()
    recompute_batchnorm_statistics(
        model, data, Context(rank, 2, rank, torch.device("cpu")), IMAGES, seed=3, batch_size=100
    )
    torch.save(model[0].state_dict(), f"{out}.{rank}")
    dist.destroy_process_group()


@pytest.mark.spawns
def test_precise_bn_spread_over_two_ranks_averages_their_shares_into_the_same_statistics(tmp_path):
    """Each rank passes half the sample; with equal batches the average of batch means is the sample mean exactly."""
    out = str(tmp_path / "stats")
    torch.multiprocessing.spawn(_precise_bn_on_a_rank, args=(str(tmp_path / "store"), out), nprocs=2)
    ranks = [torch.load(f"{out}.{rank}") for rank in range(2)]
    x, _ = shifted_data(1000)
    for stats in ranks:
        assert torch.allclose(stats["running_mean"], x.mean(0), atol=1e-4)
        assert stats["num_batches_tracked"] == 10  # 5 batches of 100 on each rank
        assert torch.equal(stats["running_var"], ranks[0]["running_var"])
    halves = [x[drawn(1000, 3)][rank::2] for rank in range(2)]
    per_batch = torch.stack([chunk.var(0) for half in halves for chunk in half.split(100)]).mean(0)
    assert torch.allclose(ranks[0]["running_var"], per_batch, rtol=1e-4)


def test_a_model_without_batchnorm_is_left_alone():
    model = nn.Linear(3, 2)
    before = [p.clone() for p in model.parameters()]
    assert not recompute_batchnorm_statistics(model, TensorDataset(torch.randn(10, 3)), CPU, IMAGES)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_eval_json_keeps_the_image_keys_and_names_every_metric_in_the_tasks_words():
    images = scored(IMAGES, {"accuracy": 0.9, "loss": 0.3}, {"accuracy": 0.8, "loss": 0.4})
    assert images["test_accuracy"] == 0.9 and images["test_accuracy_as_trained"] == 0.8 and images["test_loss"] == 0.3
    assert images["task"] == "image_classification" and images["headline"] == "accuracy"
    assert images["metrics"]["accuracy"] == {"label": "top-1 accuracy", "unit": "", "higher_is_better": True}
    text = CausalLM(token_unit="character")
    values = {"loss": 1.5, "token_accuracy": 0.5, "perplexity": 4.48, "bits": 2.16}
    lm = scored(text, values, values)
    assert {f"test_{name}" for name in values} < lm.keys() and lm["test_loss_as_trained"] == 1.5
    assert lm["metrics"]["bits"] == {"label": "bits per character", "unit": "bits", "higher_is_better": False}

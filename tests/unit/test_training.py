"""The training step every stage runs, and scoring that counts every image once."""

import copy

import torch
from torch import nn

from tests.conftest import default_job, run_on_two_ranks
from tula_hpc.distributed import Context
from tula_hpc.strategies import build_strategy
from tula_hpc.training import evaluate_accuracy, training_step


def test_accumulated_slices_take_the_same_step_as_the_whole_batch():
    job = default_job(train={"strategy": "lbt"})
    torch.manual_seed(0)
    x, y = torch.randn(50, 1, 8, 8), torch.randint(0, 10, (50,))
    template = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 10))
    weights, losses = [], []
    for slices in (1, 4):
        model = copy.deepcopy(template)
        strategy = build_strategy(model, job["train"], 50, 1)
        losses.append(training_step(model, strategy, nn.CrossEntropyLoss(), x, y, slices))
        weights.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    torch.testing.assert_close(losses[0], losses[1])
    torch.testing.assert_close(weights[0], weights[1])


class _ParityModel(nn.Module):
    """Predicts class 0 for an even-valued image and class 1 for an odd one: which images are right is known."""

    def forward(self, x):
        odd = x.reshape(len(x), -1)[:, 0].remainder(2)
        return torch.stack([1 - odd, odd], dim=1)


def _score_five_images(rank: int, outdir: str) -> None:
    """Images 0..4 labelled 0: the even ones (0, 2, 4) are right, so the accuracy is exactly 3/5."""
    images = torch.arange(5, dtype=torch.float32).reshape(5, 1, 1, 1)
    dataset = torch.utils.data.TensorDataset(images, torch.zeros(5, dtype=torch.long))
    accuracy = evaluate_accuracy(_ParityModel(), dataset, Context(rank, 2, rank, torch.device("cpu")), batch_size=2)
    torch.save(accuracy, f"{outdir}/rank{rank}.pt")


def test_two_ranks_score_every_image_exactly_once(tmp_path):
    # DistributedSampler would pad rank 1's share with image 0 (right), scoring 4/6 instead of 3/5.
    run_on_two_ranks(_score_five_images, str(tmp_path))
    assert [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)] == [0.6, 0.6]
